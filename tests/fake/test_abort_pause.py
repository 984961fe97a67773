"""An abort pause never waits on what a generation scores after its tokens (its `top_logprobs`
or `entropy`): rows an abort ended are not scored, and scoring still under way when an abort
pause begins is cancelled, its rows ending "abort" with their tokens. A paused engine starts
nothing new before the resume (as vLLM's pause does), so waiting for that scoring would hold
the pause forever. A fake engine that pauses that way shows both."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI

from app.common.service import Resolved
from app.engine.base import ScoreItem
from app.engine.types import GenerateItem, Generation, SamplingConfig, Scores, ScoreSpec
from app.generation.service import Sampled
from tests.fake.backend import FakeBackend, fake_app

ASKS = ScoreSpec(top_logprobs=2)
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def log_prob(token: int) -> float:
    return -0.01 * token


class PausingEngine(FakeBackend):
    """Ends the rows of prompts in `aborted` with "abort" after one token; scoring calls are
    held until `release`, then wait for the engine to run (a paused engine starts nothing
    new before the resume)."""

    def __init__(self, aborted: Sequence[tuple[int, ...]] = ()) -> None:
        super().__init__("policy", log_prob)
        self.aborted = set(aborted)
        self.running = asyncio.Event()
        self.running.set()
        self.release = asyncio.Event()
        self.scoring = asyncio.Event()
        self.score_calls: list[list[ScoreItem]] = []

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        out = await super().generate(items)
        for item, g in zip(items, out, strict=True):
            if item.prompt_ids in self.aborted:
                g.token_ids, g.log_probs, g.finish_reason = (
                    g.token_ids[:1],
                    g.log_probs[:1],
                    "abort",
                )
        return out

    async def abort_generations(self) -> None:
        self.running.clear()

    async def freeze(self) -> None:
        self.running.clear()

    async def thaw(self) -> None:
        self.running.set()

    async def score_detailed(self, items: Sequence[ScoreItem]) -> list[Scores]:
        self.score_calls.append(list(items))
        self.scoring.set()
        await self.release.wait()
        await self.running.wait()
        return [
            Scores(
                log_probs=torch.tensor([0.0, *(log_prob(t) for t in ids[1:])]),
                top_ids=torch.tensor([[t, 0] for t in ids[1:]]),
                top_log_probs=torch.full((len(ids) - 1, 2), -1.0),
            )
            for ids, _ in items
        ]


def sample(app: FastAPI, **asks: Any) -> Coroutine[Any, Any, Sampled]:
    """The service sampling 3 tokens for each of PROMPTS, with `asks` (asks, prompt_asks, n)."""
    prepared = app.state.registry.get("policy").preparer.prompts(None, None, PROMPTS, "tokens")
    n = asks.pop("n", 1)
    resolved = Resolved(SamplingConfig(max_new_tokens=3), **asks)
    return app.state.generation.sample("policy", prepared, resolved, n=n, seed=0)


async def test_rows_an_abort_ended_are_not_scored(tmp_path: Path) -> None:
    engine = PausingEngine(aborted=[(8, 9)])
    engine.release.set()
    async with fake_app(tmp_path, engine, FakeBackend("reference", log_prob)) as app:
        sampled = await sample(app, asks=ASKS)
    assert [g.finish_reason for g in sampled.generations] == ["length", "abort", "length"]
    (call,) = engine.score_calls
    assert [ids for ids, _ in call] == [[5, 6, 7, 72, 105, 33], [10, 11, 12, 13, 72, 105, 33]]
    assert [spec.start for _, spec in call] == [3, 4]
    assert sampled.scores_of(1) is None
    for k, start in ((0, 3), (2, 4)):
        scores = sampled.scores_of(k)
        assert scores is not None and scores.top_ids is not None
        assert scores.top_ids[start - 1 :, 0].tolist() == [72, 105, 33]


async def test_an_abort_pause_cancels_scoring_under_way_and_does_not_wait_for_it(
    tmp_path: Path,
) -> None:
    engine = PausingEngine()
    async with fake_app(tmp_path, engine, FakeBackend("reference", log_prob)) as app:
        registry = app.state.registry
        request = asyncio.create_task(sample(app, asks=ASKS))
        await asyncio.wait_for(engine.scoring.wait(), 10)  # and held there
        state = await asyncio.wait_for(registry.gate.pause("abort"), 10)
        assert state.paused and state.in_flight_generations == 0
        sampled = await asyncio.wait_for(request, 10)
        assert [g.finish_reason for g in sampled.generations] == ["abort"] * 3
        assert [g.token_ids for g in sampled.generations] == [[72, 105, 33]] * 3
        assert all(sampled.scores_of(k) is None for k in range(3))
        await registry.gate.resume()
        engine.release.set()
        again = await asyncio.wait_for(sample(app, asks=ASKS), 10)
    assert [g.finish_reason for g in again.generations] == ["length"] * 3
    assert all(again.scores_of(k) is not None for k in range(3))


async def test_an_abort_pause_during_the_prompt_scoring_pass_ends_every_row(
    tmp_path: Path,
) -> None:
    """An engine that cannot score prompts as it generates scores them first; an abort pause
    that begins then ends the request's rows before any is generated."""
    engine = PausingEngine()
    async with fake_app(tmp_path, engine, FakeBackend("reference", log_prob)) as app:
        registry = app.state.registry
        request = asyncio.create_task(sample(app, n=2, prompt_asks=ASKS))
        await asyncio.wait_for(engine.scoring.wait(), 10)
        await asyncio.wait_for(registry.gate.pause("abort"), 10)
        sampled = await asyncio.wait_for(request, 10)
        await registry.gate.resume()
    assert engine.calls == 0  # nothing was generated
    assert [g.finish_reason for g in sampled.generations] == ["abort"] * 6
    assert all(g.token_ids == [] for g in sampled.generations)
    assert sampled.prompt_scores == [None, None, None]
