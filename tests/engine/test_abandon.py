"""An abandoned generation stops at the next token: its requester is gone, so the engine
spends nothing more on it, and the request behind it starts at once instead of after it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI

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
    long = SamplingConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    big = asyncio.create_task(service.sample("policy", prompts, long, n=8, seed=1))
    while len(steps) < 8 * 5:  # decoding has started
        if big.done():  # it failed (or ended) before it got that far: say why
            pytest.fail(f"the long generation ended early: {big.result()!r}")
        await asyncio.sleep(0.005)
    big.cancel()
    with pytest.raises(asyncio.CancelledError):
        await big
    small = await service.sample("policy", prompts, SamplingConfig(max_new_tokens=3), seed=2)
    assert len(small.generations[0].token_ids) == 3
    # The small request ran after the abandoned one stopped: the big rows got far fewer
    # than their MAX_NEW tokens each (a few more at most, while the cancel reached the loop).
    big_steps = len(steps) - 3
    assert big_steps < 8 * MAX_NEW / 4, big_steps
