"""Work whose requester is gone stops at token granularity.

A request's generation items share one `Abandonment` (a `threading.Event`), set when the
request is cancelled (its client disconnected). The transformers decode loop reads it between
tokens; the vLLM backend waits on it beside its engine request and cancels that request when
it is set (vLLM aborts a request whose output stream is closed). Abandoned rows end with
finish_reason "abort"."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

R = TypeVar("R")


class Abandonment(threading.Event):
    """A request's abandonment flag: a `threading.Event` (the decode loop reads it between
    tokens) that also wakes the coroutines waiting on it, so a watcher costs nothing until
    it is set."""

    def __init__(self) -> None:
        super().__init__()
        self._waiters: set[asyncio.Future[None]] = set()
        self._waiters_lock = threading.Lock()

    def set(self) -> None:
        super().set()
        with self._waiters_lock:
            waiters, self._waiters = self._waiters, set()
        for waiter in waiters:
            with contextlib.suppress(RuntimeError):  # (its loop is closed: nobody waits)
                waiter.get_loop().call_soon_threadsafe(_resolve, waiter)

    def waiter(self) -> asyncio.Future[None]:
        """A future done once the flag is set (at once if it is); `discard` it when done
        waiting."""
        waiter = asyncio.get_running_loop().create_future()
        with self._waiters_lock:
            if not self.is_set():
                self._waiters.add(waiter)
                return waiter
        waiter.set_result(None)
        return waiter

    def discard(self, waiter: asyncio.Future[None]) -> None:
        with self._waiters_lock:
            self._waiters.discard(waiter)
        waiter.cancel()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def unless_abandoned(work: Awaitable[R], flag: Abandonment | None) -> R | None:
    """`work`'s result, or None once `flag` is set (the work is cancelled then)."""
    if flag is None:
        return await work
    task = asyncio.ensure_future(work)
    abandoned = flag.waiter()
    try:
        if not abandoned.done():  # (set already: the work is not started)
            either: set[asyncio.Future[Any]] = {task, abandoned}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    finally:
        task.cancel()
        flag.discard(abandoned)


async def unless_set(work: Awaitable[R], event: asyncio.Event) -> R | None:
    """`work`'s result, or None when `event` is set first (or already is): the work is
    cancelled then."""
    if event.is_set():
        if asyncio.iscoroutine(work):
            work.close()  # never started
        return None
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, stop):
            pending.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    return None
