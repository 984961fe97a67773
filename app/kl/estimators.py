"""Per-token KL estimators and reward shaping (pure functions; d = log p - log q)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

Estimator = Literal["k1", "k2", "k3", "abs"]
RewardPlacement = Literal["last_token", "broadcast"]

ESTIMATORS: dict[str, Callable[[float], float]] = {
    "k1": lambda d: d,
    "abs": abs,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: math.expm1(-d) + d,
}


def per_token_kl(
    policy: Sequence[float], reference: Sequence[float], mask: Sequence[int], estimator: Estimator
) -> list[float]:
    """The estimator at every counted position; 0.0 where the mask is 0."""
    formula = ESTIMATORS[estimator]
    return [
        formula(p - q) if counted else 0.0
        for p, q, counted in zip(policy, reference, mask, strict=True)
    ]


def shape_rewards(
    kl: Sequence[float],
    mask: Sequence[int],
    reward: float,
    coeff: float,
    placement: RewardPlacement,
) -> list[float]:
    """`last_token`: reward on the last counted token, -coeff*kl on every counted token
    (OpenRLHF, verl). `broadcast`: reward - coeff*kl on every counted token (TorchRL)."""
    shaped = [-coeff * k if counted else 0.0 for k, counted in zip(kl, mask, strict=True)]
    counted_positions = [t for t, counted in enumerate(mask) if counted]
    if placement == "broadcast":
        for t in counted_positions:
            shaped[t] += reward
    elif counted_positions:
        shaped[counted_positions[-1]] += reward
    return shaped
