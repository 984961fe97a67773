"""What the sync and async clients share: configuration, the call description, retry policy."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx

from rlserve_client.types import Result

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)
RETRY_STATUSES = frozenset({408, 429, 503})
MAX_BACKOFF_S = 8.0
UPLOAD_CHUNK_BYTES = 1 << 20
TENSOR_MEDIA_TYPE = "application/x-safetensors"

T = TypeVar("T", bound=Result)
# Errors raised before a byte of the request left: retrying these can never repeat it.
UNSENT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class NotGiven:
    """The type of NOT_GIVEN: "use the client's default" (None means no timeout at all)."""

    def __repr__(self) -> str:
        return "NOT_GIVEN"


NOT_GIVEN = NotGiven()
Timeout = float | httpx.Timeout | None | NotGiven


class Retry(Enum):
    """When a call may be sent again."""

    SAFE = "safe"
    """Reads and pure computations: after connection errors, timeouts, 408, 429 and 503."""
    UNSENT = "unsent"
    """Calls that change state: only when the request never left (it cannot be repeated)."""
    KEYED = "keyed"
    """Calls carrying an Idempotency-Key the server de-duplicates: as SAFE, and after a 409
    with Retry-After (another server applied a change first; this call applied nothing)."""


SESSION_HEADER = "x-session-id"
"""Ray Serve's sticky-routing header: with its consistent-hash router (`rlserve serve
--replicas N --sticky-sessions`) requests carrying the same value go to the same replica.
Sent with an environment's or a trajectory's id; a single server ignores it."""


MIN_VERSION_HEADER = "X-Min-Policy-Version"
EXACT_VERSION_HEADER = "X-Policy-Version"
"""The headers that pin the policy version a request is answered with (every route)."""


def pins(minimum: int | None, exact: int | None) -> dict[str, str]:
    """The headers of a client's version pins."""
    headers = {}
    if minimum is not None:
        headers[MIN_VERSION_HEADER] = str(minimum)
    if exact is not None:
        headers[EXACT_VERSION_HEADER] = str(exact)
    return headers


def session(key: str | None) -> dict[str, str]:
    return {SESSION_HEADER: key} if key else {}


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call and the model of its result, independent of the transport."""

    method: str
    path: str
    result: type[T]
    json: Any = None
    params: dict[str, Any] = field(default_factory=dict)
    content: bytes | Path | None = None
    progress: bool | None = False
    timeout: Timeout = NOT_GIVEN
    retry: Retry = Retry.SAFE
    headers: dict[str, str] = field(default_factory=dict)

    def parse(self, response: httpx.Response) -> T:
        if response.headers.get("content-type", "").startswith(TENSOR_MEDIA_TYPE):
            from rlserve_client.tensor_wire import construct, decode

            return construct(self.result, decode(response.content))
        body = response.json() if response.content else {}
        return self.result.model_validate(body)


def has_tensors(body: Any) -> bool:
    """Whether a request body holds a tensor or array (torch, numpy: anything with
    `__dlpack__`), so that it is sent as binary. Checked without importing torch."""
    if hasattr(body, "__dlpack__"):
        return True
    if isinstance(body, dict):
        return any(has_tensors(v) for v in body.values())
    if isinstance(body, list | tuple):
        return any(has_tensors(v) for v in body if not isinstance(v, int | float | str))
    return False


def tensor_call(
    path: str,
    result: type[T],
    body: dict[str, Any],
    *,
    tensors: bool,
    timeout: Timeout,
    headers: dict[str, str] | None = None,
) -> Call[T]:
    """A POST whose body goes as binary when it holds tensors, and whose reply comes as
    binary when `tensors` (its arrays then decode to torch tensors, not lists)."""
    headers = dict(headers or {})
    if tensors:
        headers["Accept"] = TENSOR_MEDIA_TYPE
    if not has_tensors(body):
        return Call("POST", path, result, json=body, timeout=timeout, headers=headers)
    from rlserve_client.tensor_wire import encode

    headers["Content-Type"] = TENSOR_MEDIA_TYPE
    return Call("POST", path, result, content=encode(body), timeout=timeout, headers=headers)


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
    call: Call[Any],
    attempt: int,
    max_retries: int,
    *,
    error: httpx.TransportError | None = None,
    response: httpx.Response | None = None,
) -> float | None:
    """Seconds to wait before sending `call` again, or None to stop: after a transport
    `error`, or an answer `response`. A call that changes state without an idempotency key
    is repeated only when the first try never left."""
    if attempt >= max_retries:
        return None
    if call.retry is Retry.UNSENT and not isinstance(error, UNSENT_ERRORS):
        return None
    if response is not None and response.status_code not in RETRY_STATUSES:
        # 409 with Retry-After: another server changed the state first and nothing was
        # applied; a keyed call sent again is answered as the server applied it. Or the
        # policy version the call pins is not served yet: nothing was started.
        later = response.status_code == 409 and "Retry-After" in response.headers
        if not (later and (call.retry is Retry.KEYED or _version_error(response))):
            return None
    return retry_delay(attempt, response)


def _version_error(response: httpx.Response) -> bool:
    try:
        return bool(response.json()["error"]["type"] == "version_error")
    except (ValueError, KeyError, TypeError):
        return False


def request_arguments(
    call: Call[Any], *, asynchronous: bool = False, pinned: dict[str, str] | None = None
) -> dict[str, Any]:
    """httpx.request keywords. Uploads go in 1 MiB chunks with an explicit length (a file is
    read as it is sent, never whole), so a progress bar can follow them; every attempt gets
    fresh chunks. Bytes over a chunk go in chunks too: httpx sent a 600 MiB body given whole
    at 28 MB/s here, in 1 MiB chunks at 540 MB/s."""
    headers = {**(pinned or {}), **call.headers}
    content: Any = call.content
    source = call.content
    large = isinstance(source, bytes) and len(source) > UPLOAD_CHUNK_BYTES
    if source is not None and (isinstance(source, Path) or large or call.progress is not False):
        size = source.stat().st_size if isinstance(source, Path) else len(source)
        headers["Content-Length"] = str(size)
        content = _chunks(source, size, call.progress, asynchronous)
    timeout = call.timeout
    return {
        "method": call.method,
        "url": call.path,
        "json": call.json,
        "params": call.params,
        "content": content,
        "headers": headers,
        "timeout": httpx.USE_CLIENT_DEFAULT if isinstance(timeout, NotGiven) else timeout,
    }


def _chunks(source: bytes | Path, size: int, progress: bool | None, asynchronous: bool) -> Any:
    from rlserve_client.progress import progress_bar

    def pieces() -> Iterator[bytes]:
        if isinstance(source, Path):
            with source.open("rb") as file:
                while chunk := file.read(UPLOAD_CHUNK_BYTES):
                    yield chunk
        else:
            for start in range(0, len(source), UPLOAD_CHUNK_BYTES):
                yield source[start : start + UPLOAD_CHUNK_BYTES]

    def chunks() -> Iterator[bytes]:
        with progress_bar(total=size, unit="B", desc="upload", enabled=progress) as bar:
            for chunk in pieces():
                bar.update(len(chunk))
                yield chunk

    async def async_chunks() -> AsyncIterator[bytes]:
        reader = chunks()
        if not isinstance(source, Path):  # slicing bytes in memory: no thread needed
            for piece in reader:
                yield piece
            return

        def read_next() -> bytes | None:
            return next(reader, None)

        while (chunk := await asyncio.to_thread(read_next)) is not None:
            yield chunk  # file reads happen in a thread, off the caller's event loop

    return async_chunks() if asynchronous else chunks()


def _given(**fields: Any) -> dict[str, Any]:
    """A body without the arguments that were not given."""
    return {k: v for k, v in fields.items() if v is not None}
