"""Work whose requester is gone stops at token granularity.

A request's generation items share one `threading.Event`, set when the request is cancelled
(its client disconnected). The transformers decode loop reads it between tokens; the vLLM
backend watches it and cancels its engine request (vLLM aborts a request whose output stream
is closed). Abandoned rows end with finish_reason "abort"."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable
from typing import TypeVar

R = TypeVar("R")
POLL_S = 0.05


async def unless_abandoned(work: Awaitable[R], flag: threading.Event | None) -> R | None:
    """`work`'s result, or None once `flag` is set (the work is cancelled then)."""
    if flag is None:
        return await work
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            if flag.is_set():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return None
            await asyncio.wait({task}, timeout=POLL_S)
        return task.result()
    finally:
        task.cancel()


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
