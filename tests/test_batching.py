"""Batcher semantics against a backend that records its calls."""

from __future__ import annotations

import asyncio
import time

import pytest

from app.batching import BackendCallError, Batcher, BatchingConfig, QueueFullError


class Recorder:
    """Echoes items back (x * 10), records every call, and can hold calls behind a gate."""

    def __init__(self, fail_on: object = None) -> None:
        self.calls: list[list[object]] = []
        self.call_times: list[float] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_on = fail_on

    async def run(self, items: list) -> list:  # type: ignore[type-arg]
        self.calls.append(list(items))
        self.call_times.append(time.monotonic())
        await self.gate.wait()
        if self.fail_on in items:
            raise RuntimeError("boom")
        return [item * 10 for item in items]


def batcher(recorder: Recorder, length=lambda item: 1, **config) -> Batcher:  # type: ignore[no-untyped-def]
    return Batcher("test", recorder.run, length, BatchingConfig(**config))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def blocked(recorder: Recorder, b: Batcher) -> asyncio.Task:  # type: ignore[type-arg]
    """Occupy the single call slot with a first request, so later ones queue up."""
    recorder.gate.clear()
    first = asyncio.create_task(b.submit([0]))
    await settle()
    assert recorder.calls == [[0]]
    return first


async def test_max_batch_size_respected_and_order_kept():
    recorder = Recorder()
    b = batcher(recorder, max_batch_size=4)
    first = await blocked(recorder, b)
    tasks = [asyncio.create_task(b.submit([i])) for i in range(1, 10)]
    await settle()
    recorder.gate.set()
    results = await asyncio.gather(first, *tasks)
    assert results == [[i * 10] for i in range(10)]
    assert [len(c) for c in recorder.calls] == [1, 4, 4, 1]
    assert recorder.calls[1:] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    await b.aclose()


async def test_request_larger_than_batch_is_split_and_reassembled_in_order():
    recorder = Recorder()
    b = batcher(recorder, max_batch_size=3)
    assert await b.submit(list(range(10))) == [i * 10 for i in range(10)]
    assert recorder.calls == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    await b.aclose()


async def test_token_budget_counts_padded_tokens():
    recorder = Recorder()
    b = batcher(recorder, length=lambda item: item, max_batch_size=10, max_batch_tokens=40)
    first = await blocked(recorder, b)
    tasks = [asyncio.create_task(b.submit([n])) for n in (10, 10, 10, 30, 45)]
    await settle()
    recorder.gate.set()
    await asyncio.gather(first, *tasks)
    # rows x longest: 3 x 10 = 30 fits; adding 30 would be 4 x 30; 45 alone exceeds but must run.
    assert recorder.calls[1:] == [[10, 10, 10], [30], [45]]
    await b.aclose()


async def test_timeout_flushes_a_partial_batch():
    recorder = Recorder()
    b = batcher(recorder, min_batch_size=4, timeout_s=0.05)
    start = time.monotonic()
    assert await b.submit([1, 2]) == [10, 20]
    waited = recorder.call_times[0] - start
    assert 0.045 <= waited < 1.0
    assert recorder.calls == [[1, 2]]
    await b.aclose()


async def test_min_batch_size_waits_for_company():
    recorder = Recorder()
    b = batcher(recorder, min_batch_size=3, timeout_s=30)
    one = asyncio.create_task(b.submit([1]))
    await asyncio.sleep(0.05)
    assert recorder.calls == []
    two = asyncio.create_task(b.submit([2, 3]))
    assert await asyncio.gather(one, two) == [[10], [20, 30]]
    assert recorder.calls == [[1, 2, 3]]
    await b.aclose()


async def test_backend_error_fails_exactly_the_requests_of_that_call():
    recorder = Recorder(fail_on=5)
    b = batcher(recorder, max_batch_size=2)
    first = await blocked(recorder, b)
    same_call = [asyncio.create_task(b.submit([i])) for i in (4, 5)]
    next_call = asyncio.create_task(b.submit([6]))
    await settle()
    recorder.gate.set()
    assert await first == [0]
    for task in same_call:
        with pytest.raises(BackendCallError, match="RuntimeError: boom"):
            await task
    assert await next_call == [60]
    assert await b.submit([7]) == [70]  # and it goes on
    await b.aclose()


async def test_cancelled_request_leaves_the_queue():
    recorder = Recorder()
    b = batcher(recorder, max_batch_size=8)
    first = await blocked(recorder, b)
    doomed = asyncio.create_task(b.submit([1, 2, 3]))
    kept = asyncio.create_task(b.submit([4]))
    await settle()
    assert b.stats().queued_items == 4 and b.stats().queued_requests == 2
    doomed.cancel()
    await settle()
    assert b.stats().queued_items == 1 and b.stats().queued_requests == 1
    recorder.gate.set()
    assert await kept == [40]
    await first
    assert recorder.calls == [[0], [4]]
    assert b.stats().queued_items == 0 and b.stats().queued_requests == 0
    await b.aclose()


async def test_result_of_a_request_cancelled_in_flight_is_discarded():
    recorder = Recorder()
    b = batcher(recorder, max_batch_size=8)
    recorder.gate.clear()
    doomed = asyncio.create_task(b.submit([1]))
    await settle()
    doomed.cancel()
    recorder.gate.set()
    assert await b.submit([2]) == [20]
    assert b.stats().queued_items == 0
    await b.aclose()


async def test_queue_full_is_refused():
    recorder = Recorder()
    b = batcher(recorder, max_queue=2)
    first = await blocked(recorder, b)
    waiting = [asyncio.create_task(b.submit([i, i])) for i in (1, 2)]
    await settle()
    with pytest.raises(QueueFullError):
        await b.submit([3])
    recorder.gate.set()
    assert await asyncio.gather(first, *waiting) == [[0], [10, 10], [20, 20]]
    assert await b.submit([3]) == [30]
    await b.aclose()


async def test_stats_report_batch_sizes():
    recorder = Recorder()
    b = batcher(recorder, max_batch_size=2)
    await b.submit([1, 2, 3])
    stats = b.stats()
    assert (stats.num_calls, stats.num_items, stats.last_batch_sizes) == (2, 3, [2, 1])
    await b.aclose()
