"""One worker thread that runs calls in order, awaited from the event loop.

The hot paths hand work to a thread of its own (the tokenizer's, a SQLite connection's)
several times per request. `loop.run_in_executor` on a one-thread `ThreadPoolExecutor` pays,
per call, for a `concurrent.futures.Future` (with its own Condition), the executor's locked
queue and the chaining of that future to an asyncio one. A lane puts the call and an asyncio
future on a `queue.SimpleQueue` and settles the future with one `call_soon_threadsafe`: about
a fifth of the CPU per call under load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

_Call = tuple[Callable[[], Any], "asyncio.Future[Any] | None"]
_STOP: Any = object()


class Lane:
    def __init__(self, name: str) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._closed = False
        # The thread holds the queue, not the lane: a lane nobody closed stops its thread when
        # it is collected (as a ThreadPoolExecutor does), and never holds up the exit (daemon).
        self._thread = threading.Thread(
            target=_serve, args=(self._calls, name), name=name, daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._calls.put, (_STOP, None))

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the lane's thread, after the calls before it. A call whose caller
        stopped waiting before it started is skipped."""
        if self._closed:
            raise RuntimeError(f"lane {self.name} is closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._calls.put((lambda: fn(*args), future))
        return await future

    def submit(self, fn: Callable[[], Any]) -> None:
        """`fn()` on the lane's thread, not awaited (it reports its outcome itself)."""
        if self._closed:
            raise RuntimeError(f"lane {self.name} is closed")
        self._calls.put((fn, None))

    def close(self, *, wait: bool) -> None:
        """Run what is queued, then stop; `wait` for that (never from the lane's thread).
        Calls made after it raise RuntimeError."""
        if not self._closed:
            self._closed = True
            self._calls.put((_STOP, None))
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()


def _serve(calls: queue.SimpleQueue[_Call], name: str) -> None:
    while True:
        fn, future = calls.get()
        if fn is _STOP:
            return
        if future is None:
            try:
                fn()
            except BaseException:  # it was to report its own outcome: the lane goes on
                logger.exception("a call on lane %s failed", name)
            continue
        if future.cancelled():  # read across threads: at worst the call runs anyway
            continue
        try:
            outcome = (True, fn())
        except BaseException as error:  # handed to its caller
            outcome = (False, error)
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting
            future.get_loop().call_soon_threadsafe(settle, future, *outcome)


def settle(future: asyncio.Future[Any], succeeded: bool, value: Any) -> None:
    """Give `future` a call's outcome (on its loop) unless its caller stopped waiting."""
    if future.cancelled():
        return
    if succeeded:
        future.set_result(value)
    else:
        future.set_exception(value)
