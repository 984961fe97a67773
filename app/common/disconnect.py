"""Drop a request's queued model work when its client goes away."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (the body is already read,
    so the next ASGI message can only be the disconnect), or if this request is cancelled
    itself (as when the shutdown grace is over)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        unfinished = [t for t in (task, watcher) if not t.done()]
        for pending in unfinished:
            pending.cancel()
        await asyncio.gather(*unfinished, return_exceptions=True)
    if task.cancelled():
        raise asyncio.CancelledError("client disconnected")
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
