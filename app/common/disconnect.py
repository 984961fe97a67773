"""Drop a request's work when its client goes away. A route declares it once, with
`@cancellable` under its router decorator (its router's route class must be
`CancellableRoute` or a subclass): the whole endpoint then runs as a task that is cancelled
when the client disconnects, queued model work included."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__rlserve_cancellable__"


def cancellable(endpoint: F) -> F:
    """Mark an endpoint to be cancelled when its client goes away."""
    setattr(endpoint, _MARK, True)
    return endpoint


class CancellableRoute(APIRoute):
    """Runs the endpoints marked `cancellable` under `cancel_on_disconnect`, the body read
    first (so the watcher can only see the disconnect)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if not getattr(self.endpoint, _MARK, False):
            return handler

        async def cancelling(request: Request) -> Response:
            await request.body()
            return await cancel_on_disconnect(request, handler(request))

        return cancelling


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
