"""One worker thread that runs calls in order, awaited from the event loop.

The hot paths hand work to a thread of its own (the tokenizer's, a SQLite connection's)
several times per request. `loop.run_in_executor` on a one-thread `ThreadPoolExecutor` pays,
per call, for a `concurrent.futures.Future` (with its own Condition), the executor's locked
queue and the chaining of that future to an asyncio one. A lane puts the call and an asyncio
future on a `queue.SimpleQueue` and settles the future with one `call_soon_threadsafe`: about
a fifth of the CPU per call under load.

A lane made `by_cost` runs the cheapest call waiting first (equal costs in order): a tokenizer's
lane, where one request's long texts must not hold up the short ones queued behind them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
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
_LAST = float("inf")  # (the stop's cost: after every call queued before it)


class _ByCost:
    """The calls waiting on a `by_cost` lane: the cheapest first, equal costs in order."""

    def __init__(self) -> None:
        self._heap: queue.PriorityQueue[tuple[float, int, _Call]] = queue.PriorityQueue()
        self._order = itertools.count()

    def put(self, call: _Call, cost: float = 0.0) -> None:
        self._heap.put((_LAST if call[0] is _STOP else cost, next(self._order), call))

    def get(self) -> _Call:
        return self._heap.get()[2]


class Lane:
    def __init__(self, name: str, *, by_cost: bool = False) -> None:
        self.name = name
        self._calls: queue.SimpleQueue[_Call] | _ByCost = (
            _ByCost() if by_cost else queue.SimpleQueue()
        )
        self._closed = False
        # The thread holds the queue, not the lane: a lane nobody closed stops its thread when
        # it is collected (as a ThreadPoolExecutor does), and never holds up the exit (daemon).
        self._thread = threading.Thread(
            target=_serve, args=(self._calls, name), name=name, daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._calls.put, (_STOP, None))

    async def run(self, fn: Callable[..., T], *args: Any, cost: float = 0.0) -> T:
        """`fn(*args)` on the lane's thread, after the calls before it (on a `by_cost` lane:
        after those waiting that cost less, `cost` in any unit the lane's callers share). A
        call whose caller stopped waiting before it started is skipped."""
        if self._closed:
            raise RuntimeError(f"lane {self.name} is closed")
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        call: _Call = (lambda: fn(*args), future)
        if isinstance(self._calls, _ByCost):
            self._calls.put(call, cost)
        else:
            self._calls.put(call)
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


def _serve(calls: queue.SimpleQueue[_Call] | _ByCost, name: str) -> None:
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
