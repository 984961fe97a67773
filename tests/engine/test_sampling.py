"""The transformers backend's sampler: a row's draws follow its processed distribution, never
take a token of probability 0, and depend on its seed alone (not on the rows beside it)."""

from __future__ import annotations

import math

import torch

from app.engine.sampling import RowSampler, inverse_cdf
from app.engine.types import SamplingConfig


def test_inverse_cdf_takes_the_token_whose_interval_holds_the_draw():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25, 0.0]])
    for uniform, token in [(0.0, 0), (0.4999, 0), (0.5, 2), (0.74, 2), (0.75, 3)]:
        assert inverse_cdf(probs, torch.tensor([uniform], dtype=torch.float64)).item() == token
    # The largest draw below 1 stays on the last token of positive probability.
    assert inverse_cdf(probs, torch.tensor([math.nextafter(1.0, 0.0)])).item() == 3
    # ... also where the float32 probabilities sum to a little less than 1
    short = torch.tensor([[0.1] * 9 + [0.0]])
    assert inverse_cdf(short, torch.tensor([math.nextafter(1.0, 0.0)])).item() == 8


def test_draws_follow_the_processed_distribution():
    """20,000 draws of one row at temperature 2 and top-p 0.95: Pearson's chi-square
    against the distribution its log-probs give is within the 1e-6 tail (7 degrees of
    freedom: 39.3); tokens the filter removed are never drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -6.0]])
    config = SamplingConfig(max_new_tokens=1, temperature=2.0, top_p=0.95)
    sampler = RowSampler([config], [11], torch.device("cpu"))
    processed = sampler.process(logits.clone(), None)
    expected = processed.softmax(-1)[0]
    draws = 20_000
    counts = torch.zeros(10)
    for _ in range(draws):
        counts[sampler.choose(processed)] += 1
    kept = expected > 0
    assert counts[~kept].sum() == 0 and int(kept.sum()) == 8
    chi_square = (((counts - draws * expected)[kept]) ** 2 / (draws * expected[kept])).sum()
    assert chi_square < 39.3, (counts, expected)


def test_a_rows_draws_depend_on_its_seed_alone():
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(3))
    sampled = SamplingConfig(max_new_tokens=1)
    greedy = SamplingConfig.resolve(1, greedy=True, temperature=None)

    def draws(configs: list[SamplingConfig], seeds: list[int], row: int) -> list[int]:
        sampler = RowSampler(configs, seeds, torch.device("cpu"))
        batch = logits.expand(len(configs), -1)
        return [int(sampler.choose(sampler.process(batch.clone(), None))[row]) for _ in range(50)]

    alone = draws([sampled], [42], 0)
    assert draws([greedy, sampled, sampled], [1, 42, 7], 1) == alone
    assert draws([sampled], [43], 0) != alone
    assert set(draws([greedy, sampled], [1, 42], 0)) == {int(logits.argmax())}
