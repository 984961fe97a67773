"""Drop a request's work when its client goes away. A route declares it once, with
`@cancellable` under its router decorator (its router's route class must be
`CancellableRoute` or a subclass): the whole endpoint then runs as a task that is cancelled
when the client disconnects, queued model work included."""

from __future__ import annotations

import asyncio
import contextlib
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
    """Await `work` in this task, cancelled if the client disconnects first (the body is
    already read, so the next ASGI message can only be the disconnect), or if this request is
    cancelled itself (as when the shutdown grace is over). One watcher task per request: the
    work runs in the request's own task, not in a task of its own."""
    current = asyncio.current_task()
    if current is None:
        raise RuntimeError("cancel_on_disconnect runs inside a task")
    watcher = asyncio.create_task(_cancel_on_disconnect(request, current))
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():  # it saw the client go
            raise asyncio.CancelledError("client disconnected") from None
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)


async def _cancel_on_disconnect(request: Request, task: asyncio.Task[Any]) -> None:
    """Cancel `task` once its client goes away, or once its connection cannot be read."""
    with contextlib.suppress(Exception):
        while (await request.receive())["type"] != "http.disconnect":
            pass
    task.cancel("client disconnected")
