"""What the sync and async clients share: configuration, request building and retry policy."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
RETRY_STATUSES = frozenset({408, 429, 503})
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class Call:
    """One API call, independent of the transport that sends it."""

    method: str
    path: str
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None


def settings(base_url: str | None, api_key: str | None) -> tuple[str, dict[str, str]]:
    url = (base_url or os.environ.get("RLSERVE_URL") or DEFAULT_URL).rstrip("/")
    key = api_key if api_key is not None else os.environ.get("RLSERVE_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return url, headers


def retry_delay(attempt: int, response: httpx.Response | None) -> float:
    """Honour Retry-After (seconds) when the server sends it, else jittered exponential backoff."""
    if response is not None:
        header = response.headers.get("retry-after")
        if header is not None:
            try:
                return min(max(float(header), 0.0), MAX_BACKOFF_S * 4)
            except ValueError:
                pass
    backoff: float = min(0.5 * 2**attempt, MAX_BACKOFF_S)
    return backoff * (0.75 + random.random() / 2)


def next_delay(
    attempt: int, max_retries: int, response: httpx.Response | None = None
) -> float | None:
    """Seconds to wait before retrying, or None to stop. `response` None means the request got
    no answer (a connection error or timeout), which is always worth a retry."""
    if attempt >= max_retries:
        return None
    if response is not None and response.status_code not in RETRY_STATUSES:
        return None
    return retry_delay(attempt, response)


def request_arguments(call: Call, timeout: Any) -> dict[str, Any]:
    return {
        "method": call.method,
        "url": call.path,
        "json": call.json,
        "params": call.params,
        "content": call.content,
        "timeout": timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
    }


def inputs(
    messages: Any = None, text: Any = None, tokens: Any = None, **more: Any
) -> dict[str, Any]:
    """The request body without the arguments that were not given."""
    body = {"messages": messages, "text": text, "tokens": tokens, **more}
    return {k: v for k, v in body.items() if v is not None}
