"""An abandoned generation stops at the next token: its requester is gone, so the engine
spends nothing more on it, and the request behind it starts at once instead of after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI

from app.common.service import Resolved
from app.engine.transformers import decode as hf_decode
from app.engine.types import SamplingConfig

MAX_NEW = 400


async def test_a_cancelled_request_stops_decoding_at_the_next_token(
    app: FastAPI, backend_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if backend_name != "transformers":
        pytest.skip("counts the transformers decode loop's steps")
    steps: list[int] = []
    real = hf_decode._advance

    def counted(rows: Any, i: int, *rest: Any) -> None:
        steps.append(i)
        real(rows, i, *rest)

    monkeypatch.setattr(hf_decode, "_advance", counted)
    service = app.state.generation
    preparer = app.state.registry.get("policy").preparer
    prompts = preparer.prompts(None, None, [[5, 6, 7]], "tokens")
    long = Resolved(SamplingConfig(max_new_tokens=MAX_NEW, ignore_eos=True))
    big = asyncio.create_task(service.sample("policy", prompts, long, n=8, seed=1))
    while len(steps) < 8 * 5:  # decoding has started
        if big.done():  # it failed (or ended) before it got that far: say why
            pytest.fail(f"the long generation ended early: {big.result()!r}")
        await asyncio.sleep(0.005)
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    small = await service.sample(
        "policy", prompts, Resolved(SamplingConfig(max_new_tokens=3)), seed=2
    )
    assert len(small.generations[0].token_ids) == 3
    # The small request ran after the abandoned one stopped: the big rows got far fewer
    # than their MAX_NEW tokens each (a few more at most, while the cancel reached the loop).
    big_steps = len(steps) - 3
    assert big_steps < 8 * MAX_NEW / 4, big_steps


async def test_an_abandonment_wakes_its_watchers_from_any_thread() -> None:
    """`unless_abandoned` waits on an `Abandonment`: set from another thread or from the
    loop, the watched work is cancelled and None returned at once; work that ends first
    returns its result and leaves no waiter."""
    import threading

    from app.engine.abandon import Abandonment, unless_abandoned

    for setter in ("thread", "loop"):
        flag, cancelled = Abandonment(), asyncio.Event()

        async def forever(cancelled: asyncio.Event = cancelled) -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                cancelled.set()

        if setter == "thread":
            threading.Timer(0.2, flag.set).start()
        else:
            asyncio.get_running_loop().call_later(0.2, flag.set)
        assert await asyncio.wait_for(unless_abandoned(forever(), flag), 10) is None
        assert cancelled.is_set()
        assert await unless_abandoned(asyncio.sleep(0, "late"), flag) is None  # set already

    flag = Abandonment()
    assert await unless_abandoned(asyncio.sleep(0.01, "done"), flag) == "done"
    assert not flag._waiters
    flag.set()  # nobody waits: nothing to wake
