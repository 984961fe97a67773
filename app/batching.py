"""Async request batching: concurrent requests share backend calls.

Each request's items (sequences) are queued individually; a worker forms batches of up to
`max_batch_size` items and `max_batch_tokens` padded tokens, launching a batch as soon as
`min_batch_size` items wait, or when the oldest has waited `timeout_s` (a partial batch really
flushes). A request larger than a batch is split across calls and reassembled in order. A backend
error fails exactly the items of its call; a cancelled request leaves the queue at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.common.failures import Failure

logger = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass(frozen=True)
class BatchingConfig:
    min_batch_size: int = 1
    max_batch_size: int = 32
    timeout_s: float = 0.01
    max_batch_tokens: int = 65536
    max_queue: int = 1024
    max_concurrent_calls: int = 1


class QueueFullError(Failure):
    """The queue holds `max_queue` waiting requests already."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"server overloaded, retry later ({detail})")


class BackendCallError(Failure):
    """The backend call that carried this item failed."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"model call failed: {detail}")


@dataclass
class _Request:
    num_queued: int


@dataclass
class _Pending(Generic[Item, Result]):
    item: Item
    length: int
    future: asyncio.Future[Result]
    request: _Request
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class BatcherStats:
    queued_items: int
    queued_requests: int
    in_flight_calls: int
    num_calls: int
    num_items: int
    last_batch_sizes: list[int]


class Batcher(Generic[Item, Result]):
    """Queue of items with futures; `run` gets a list of items and returns results in order."""

    def __init__(
        self,
        name: str,
        run: Callable[[list[Item]], Awaitable[list[Result]]],
        length: Callable[[Item], int],
        config: BatchingConfig,
    ) -> None:
        self.name = name
        self.config = config
        self._run = run
        self._length = length
        self._queue: deque[_Pending[Item, Result]] = deque()
        self._queued_requests = 0
        self._wakeup = asyncio.Event()
        self._slots = asyncio.Semaphore(config.max_concurrent_calls)
        self._calls: set[asyncio.Task[None]] = set()
        self._worker: asyncio.Task[None] | None = None
        self._num_calls = 0
        self._num_items = 0
        self._last_sizes: deque[int] = deque(maxlen=32)

    async def submit(self, items: Sequence[Item]) -> list[Result]:
        """Queue `items` and wait for their results; cancelling this drops them from the queue."""
        if self._queued_requests >= self.config.max_queue:
            raise QueueFullError(f"{self.name}: {self._queued_requests} requests already waiting")
        self._ensure_worker()
        loop = asyncio.get_running_loop()
        request = _Request(num_queued=len(items))
        pending = [
            _Pending(item, self._length(item), loop.create_future(), request) for item in items
        ]
        self._queue.extend(pending)
        self._queued_requests += 1
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except BaseException:
            self._drop(pending)
            raise

    def _drop(self, pending: list[_Pending[Item, Result]]) -> None:
        """Remove a failed or cancelled request's items that are still queued."""
        for p in pending:
            if p.future.done() and not p.future.cancelled():
                p.future.exception()  # mark retrieved: the request already failed as a whole
            p.future.cancel()
        still_queued = {id(p) for p in pending}
        if any(id(p) in still_queued for p in self._queue):
            self._queue = deque(p for p in self._queue if id(p) not in still_queued)
            self._queued_requests -= 1

    def stats(self) -> BatcherStats:
        return BatcherStats(
            queued_items=len(self._queue),
            queued_requests=self._queued_requests,
            in_flight_calls=len(self._calls),
            num_calls=self._num_calls,
            num_items=self._num_items,
            last_batch_sizes=list(self._last_sizes),
        )

    # -- worker -------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name=f"batcher-{self.name}")

    async def _work(self) -> None:
        while True:
            await self._wait_for_batch()
            await self._slots.acquire()
            batch = self._take()
            if not batch:
                self._slots.release()
                continue
            task = asyncio.create_task(self._call(batch))
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
            # (else this frame holds the last batch's items, and what they name, such as an
            # adapter version, until the next batch comes)
            del batch, task

    async def _wait_for_batch(self) -> None:
        while not self._queue:
            self._wakeup.clear()
            await self._wakeup.wait()
        deadline = self._queue[0].enqueued_at + self.config.timeout_s
        while self._queue and len(self._queue) < self.config.min_batch_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), remaining)

    def _take(self) -> list[_Pending[Item, Result]]:
        """Pop the next batch: FIFO, bounded by item count and padded tokens (rows x longest)."""
        batch: list[_Pending[Item, Result]] = []
        longest = 0
        while self._queue and len(batch) < self.config.max_batch_size:
            head = self._queue[0]
            if head.future.done():  # cancelled while queued
                self._queue.popleft()
                continue
            padded = (len(batch) + 1) * max(longest, head.length)
            if batch and padded > self.config.max_batch_tokens:
                break
            self._queue.popleft()
            longest = max(longest, head.length)
            batch.append(head)
            head.request.num_queued -= 1
            if head.request.num_queued == 0:
                self._queued_requests -= 1
        return batch

    async def _call(self, batch: list[_Pending[Item, Result]]) -> None:
        try:
            results = await self._run([p.item for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"backend returned {len(results)} results for {len(batch)}")
        except Exception as exc:
            logger.exception("%s: backend call with %d items failed", self.name, len(batch))
            error = BackendCallError(f"{type(exc).__name__}: {exc}")
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(error)
        else:
            for p, result in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(result)
        finally:
            self._num_calls += 1
            self._num_items += len(batch)
            self._last_sizes.append(len(batch))
            self._slots.release()

    async def aclose(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        if self._calls:
            await asyncio.gather(*self._calls, return_exceptions=True)
        for p in self._queue:
            if not p.future.done():
                p.future.set_exception(BackendCallError("server is shutting down"))
        self._queue.clear()
