"""`TopKCategorical` against torch's own Categorical over the same truncated distribution."""

from __future__ import annotations

import pytest
import torch
from rlserve_client.distributions import IGNORE_INDEX, TopKCategorical
from torch.distributions import Categorical

B, T, V, K = 3, 6, 40, 5


@pytest.fixture
def full() -> torch.Tensor:
    """Log-probs of a random full distribution per position, `[B, T, V]`."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(B, T, V, generator=generator) * 2).log_softmax(-1)


@pytest.fixture
def mask() -> torch.Tensor:
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, :2] = False  # left padding and a first token
    mask[1, 0] = False
    return mask


def top_k(full: torch.Tensor, mask: torch.Tensor) -> TopKCategorical:
    """What the server sends: the top ids and their full log-probs, NaN / -1 where masked."""
    values, ids = full.topk(K, dim=-1)
    values = values.masked_fill(~mask.unsqueeze(-1), torch.nan)
    ids = ids.masked_fill(~mask.unsqueeze(-1), -1)
    return TopKCategorical(ids, values, mask)


def truncated(full: torch.Tensor) -> Categorical:
    """The independent computation: the full distribution with all but the top k removed."""
    kth = full.topk(K, dim=-1).values[..., -1:]
    return Categorical(logits=full.masked_fill(full < kth, -torch.inf))


def test_log_prob_equals_the_truncated_categorical(full, mask):
    dist, reference = top_k(full, mask), truncated(full)
    for token in range(V):
        value = torch.full((B, T), token)
        expected = reference.log_prob(value).masked_fill(~mask, 0.0)
        torch.testing.assert_close(dist.log_prob(value), expected)
    # raw_log_prob: the full distribution's value where the token is in the top k
    top = full.argmax(-1)
    raw = full.gather(-1, top.unsqueeze(-1)).squeeze(-1).masked_fill(~mask, 0.0)
    torch.testing.assert_close(dist.raw_log_prob(top), raw)
    outside = full.argmin(-1)
    assert bool(torch.isneginf(dist.raw_log_prob(outside)[mask]).all())


def test_ignore_index_and_masked_positions_score_zero(full, mask):
    dist = top_k(full, mask)
    value = full.argmax(-1)
    value[2, 3] = IGNORE_INDEX
    scored = dist.log_prob(value)
    assert scored[2, 3] == 0.0
    assert bool((scored[~mask] == 0.0).all())
    assert bool((scored[mask & (value != IGNORE_INDEX)] < 0).all())


def test_entropy_mode_mass_and_probs(full, mask):
    dist, reference = top_k(full, mask), truncated(full)
    torch.testing.assert_close(dist.entropy(), reference.entropy().masked_fill(~mask, 0.0))
    assert torch.equal(dist.mode[mask], full.argmax(-1)[mask])
    kept = full.topk(K, dim=-1).values.exp().sum(-1)
    torch.testing.assert_close(dist.truncated_mass, (1 - kept).masked_fill(~mask, 0.0))
    torch.testing.assert_close(dist.probs.sum(-1), torch.ones(B, T))


def test_samples_follow_the_renormalized_top_k(full, mask):
    dist, reference = top_k(full, mask), truncated(full)
    torch.manual_seed(0)
    draws = dist.sample((4000,))
    assert draws.shape == (4000, B, T)
    in_top = (draws.unsqueeze(-1) == dist.ids).any(-1)
    assert bool(in_top[:, mask].all())
    # empirical frequencies of one position against the reference probabilities
    counts = torch.bincount(draws[:, 2, 4], minlength=V).float() / 4000
    torch.testing.assert_close(counts, reference.probs[2, 4], atol=0.03, rtol=0)


def test_expand_and_shape_errors(full, mask):
    dist = top_k(full[0], mask[0])
    wide = dist.expand((2, T))
    assert wide.batch_shape == (2, T)
    torch.testing.assert_close(wide.entropy()[1], dist.entropy())
    with pytest.raises(ValueError, match="mask"):
        TopKCategorical(dist.ids, dist.raw_log_probs, mask)
