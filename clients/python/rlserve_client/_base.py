"""What the sync and async clients share: configuration, the call description, retry policy."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import httpx

from rlserve_client.types import Result

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
RETRY_STATUSES = frozenset({408, 429, 503})
MAX_BACKOFF_S = 8.0
UPLOAD_CHUNK_BYTES = 1 << 20

T = TypeVar("T", bound=Result)
Timeout = float | httpx.Timeout | None


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call and the model of its result, independent of the transport."""

    method: str
    path: str
    result: type[T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None
    progress: bool | None = False
    timeout: Timeout = None

    def parse(self, response: httpx.Response) -> T:
        body = response.json() if response.content else {}
        return self.result.model_validate(body)


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


def request_arguments(call: Call[Any], *, asynchronous: bool = False) -> dict[str, Any]:
    """httpx.request keywords. Uploads go in 1 MiB chunks with an explicit length, so a
    progress bar can follow them; every attempt gets fresh chunks."""
    headers: dict[str, str] = {}
    content: Any = call.content
    if call.content is not None and call.progress is not False:
        headers["Content-Length"] = str(len(call.content))
        content = _chunks(call.content, call.progress, asynchronous)
    return {
        "method": call.method,
        "url": call.path,
        "json": call.json,
        "params": call.params,
        "content": content,
        "headers": headers,
        "timeout": call.timeout if call.timeout is not None else httpx.USE_CLIENT_DEFAULT,
    }


def _chunks(data: bytes, progress: bool | None, asynchronous: bool) -> Any:
    from rlserve_client.progress import progress_bar

    def chunks() -> Iterator[bytes]:
        with progress_bar(total=len(data), unit="B", desc="upload", enabled=progress) as bar:
            for start in range(0, len(data), UPLOAD_CHUNK_BYTES):
                chunk = data[start : start + UPLOAD_CHUNK_BYTES]
                bar.update(len(chunk))
                yield chunk

    async def async_chunks() -> AsyncIterator[bytes]:
        for chunk in chunks():
            yield chunk

    return async_chunks() if asynchronous else chunks()
