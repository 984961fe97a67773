"""The worker thread the tokenizer and the SQLite stores hand their calls to."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from app.common.lane import Lane


async def test_calls_run_in_order_on_the_lanes_thread_and_return_their_results() -> None:
    lane = Lane("test-lane")
    seen: list[tuple[int, str]] = []

    def record(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        return i * i

    try:
        results = await asyncio.gather(*(lane.run(record, i) for i in range(50)))
    finally:
        lane.close(wait=True)
    assert results == [i * i for i in range(50)]
    assert seen == [(i, "test-lane") for i in range(50)]


async def test_a_calls_exception_reaches_its_caller_and_the_lane_goes_on() -> None:
    lane = Lane("test-lane")

    def fail() -> None:
        raise KeyError("missing")

    try:
        with pytest.raises(KeyError, match="missing"):
            await lane.run(fail)
        assert await lane.run(len, "four") == 4
    finally:
        lane.close(wait=True)


async def test_a_call_whose_caller_stopped_waiting_before_it_started_is_skipped() -> None:
    lane = Lane("test-lane")
    started, release = threading.Event(), threading.Event()
    ran: list[str] = []

    def block() -> None:
        started.set()
        release.wait(10)

    try:
        blocking = asyncio.create_task(lane.run(block))
        await asyncio.to_thread(started.wait, 10)
        waiting = asyncio.create_task(lane.run(ran.append, "skipped"))
        await asyncio.sleep(0)  # queued behind the blocking call
        waiting.cancel()
        await asyncio.sleep(0)
        release.set()
        await blocking
        assert await lane.run(ran.append, "ran") is None
    finally:
        lane.close(wait=True)
    assert waiting.cancelled()
    assert ran == ["ran"]


async def test_closing_runs_what_is_queued_then_refuses_new_calls() -> None:
    lane = Lane("test-lane")
    done: list[int] = []
    lane.submit(lambda: done.append(1))
    lane.submit(lambda: 1 / 0)  # logged; the lane goes on
    lane.submit(lambda: done.append(2))
    lane.close(wait=True)
    assert done == [1, 2]
    with pytest.raises(RuntimeError, match="closed"):
        await lane.run(len, "x")


async def test_a_lane_nobody_closed_stops_its_thread_when_it_is_collected() -> None:
    lane = Lane("test-lane-dropped")
    assert await lane.run(len, "ab") == 2
    thread = lane._thread
    del lane
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


async def test_a_lane_by_cost_runs_the_cheapest_waiting_call_first_and_stops_last() -> None:
    lane = Lane("test-lane", by_cost=True)
    ran: list[str] = []
    busy, release = threading.Event(), threading.Event()

    def occupy() -> None:
        busy.set()
        release.wait(10)

    held = asyncio.ensure_future(lane.run(occupy))
    await asyncio.to_thread(busy.wait, 10)
    calls = [
        asyncio.ensure_future(lane.run(ran.append, name, cost=cost))
        for name, cost in (("five", 5), ("one", 1), ("three", 3), ("one again", 1))
    ]
    await asyncio.sleep(0.05)
    release.set()
    await asyncio.gather(held, *calls)
    lane.close(wait=True)
    assert ran == ["one", "one again", "three", "five"]
