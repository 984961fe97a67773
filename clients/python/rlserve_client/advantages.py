"""Group-normalised advantages (GRPO), as TorchRL's `MCAdvantage` computes them."""

from __future__ import annotations

import statistics


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """(r - group mean) / group std over consecutive groups of `group_size` (unbiased std,
    clamped at 1e-6: a group of equal rewards gets advantage 0)."""
    if group_size < 2 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    advantages: list[float] = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = statistics.fmean(group)
        std = max(statistics.stdev(group), 1e-6)
        advantages.extend((r - mean) / std for r in group)
    return advantages
