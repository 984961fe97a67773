"""Prompt scores (vLLM's prompt_logprobs) are taken from the generation's own pass where the
engine can score prompts as it generates (top-k and ranks), and from a scoring pass of their
own otherwise; a prompt whose row was aborted before its scores came back has none (it is not
scored again: during an abort pause the engine admits nothing new). A fake engine records what
it was asked, so the passes are counted exactly."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from app.common.service import Resolved
from app.engine.base import Capabilities, ScoreItem
from app.engine.types import GenerateItem, Generation, SamplingConfig, Scores, ScoreSpec
from tests.fake.backend import FakeBackend, fake_app

ASKS = ScoreSpec(top_logprobs=2, ranks=True)


def log_prob(token: int) -> float:
    return -0.01 * token


def scored(ids: Sequence[int], source: float) -> Scores:
    """Scores a test can trace back: `source` marks which pass made them."""
    rows = len(ids) - 1
    return Scores(
        log_probs=torch.tensor([0.0, *(log_prob(t) for t in ids[1:])]),
        ranks=torch.full((rows,), 1),
        top_ids=torch.tensor([[t, 0] for t in ids[1:]]),
        top_log_probs=torch.full((rows, 2), source),
    )


class ScoringEngine(FakeBackend):
    """Scores the prompts of rows that ask (except prompts listed in `lose`, as an engine does
    with a row aborted before its prompt was scored) and answers scoring calls; records both."""

    def __init__(self, in_pass: bool, lose: Sequence[tuple[int, ...]] = ()) -> None:
        super().__init__("policy", log_prob)
        self.capabilities = Capabilities(prompt_scores=in_pass)
        self.lose = set(lose)
        self.generated: list[GenerateItem] = []
        self.score_calls: list[list[ScoreItem]] = []

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        self.generated.extend(items)
        out = await super().generate(items)
        for item, g in zip(items, out, strict=True):
            if item.prompt_asks is not None and item.prompt_ids not in self.lose:
                g.prompt_scores = scored(item.prompt_ids, source=1.0)
        return out

    async def score_detailed(self, items: Sequence[ScoreItem]) -> list[Scores]:
        self.score_calls.append(list(items))
        return [scored(ids, source=2.0) for ids, _ in items]


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


async def sample(
    tmp: Path, engine: ScoringEngine, n: int, asks: ScoreSpec = ASKS
) -> tuple[list[Scores | None], ScoringEngine]:
    async with fake_app(tmp, engine, FakeBackend("reference", log_prob)) as app:
        preparer = app.state.registry.get("policy").preparer
        prepared = preparer.prompts(None, None, PROMPTS, "tokens")
        resolved = Resolved(SamplingConfig(max_new_tokens=2), prompt_asks=asks)
        sampled = await app.state.generation.sample("policy", prepared, resolved, n=n, seed=0)
    assert sampled.prompt_scores is not None
    assert len(sampled.generations) == len(PROMPTS) * n
    return sampled.prompt_scores, engine


@pytest.mark.parametrize("n", [1, 3])
async def test_an_engine_that_scores_in_pass_is_asked_once_per_prompt(tmp_path, n):
    scores, engine = await sample(tmp_path, ScoringEngine(in_pass=True), n)
    assert engine.score_calls == []
    # only each prompt's first row asks; the others just generate
    asking = [item.prompt_ids for item in engine.generated if item.prompt_asks == ASKS]
    assert asking == [tuple(p) for p in PROMPTS]
    assert sum(item.prompt_asks is None for item in engine.generated) == len(PROMPTS) * (n - 1)
    for prompt, s in zip(PROMPTS, scores, strict=True):
        assert s is not None
        assert s.log_probs.tolist() == pytest.approx([0.0, *(log_prob(t) for t in prompt[1:])])
        assert s.top_log_probs is not None and bool((s.top_log_probs == 1.0).all())


async def test_other_engines_score_prompts_in_a_pass_of_their_own(tmp_path):
    scores, engine = await sample(tmp_path, ScoringEngine(in_pass=False), 2)
    assert all(item.prompt_asks is None for item in engine.generated)
    assert engine.score_calls == [[(p, ASKS) for p in PROMPTS]]
    for s in scores:
        assert s is not None and s.top_log_probs is not None
        assert bool((s.top_log_probs == 2.0).all())


async def test_asks_beyond_top_k_and_ranks_take_a_pass_of_their_own_on_any_engine(tmp_path):
    entropy = ScoreSpec(top_logprobs=1, entropy=True)
    scores, engine = await sample(tmp_path, ScoringEngine(in_pass=True), 1, entropy)
    assert all(item.prompt_asks is None for item in engine.generated)
    assert engine.score_calls == [[(p, entropy) for p in PROMPTS]]
    assert all(s is not None for s in scores)


async def test_a_prompt_aborted_before_it_was_scored_has_no_scores(tmp_path):
    lost = tuple(PROMPTS[1])
    scores, engine = await sample(tmp_path, ScoringEngine(in_pass=True, lose=[lost]), 2)
    assert engine.score_calls == []
    assert scores[1] is None
    assert [s is not None for s in scores] == [True, False, True]
