"""Decoupled PPO: the policy-gradient loss for tokens sampled by older weights.

Three log-probs per token:

- `behaviour`: what the sampler saw, under the policy version that sampled the token (rlserve
  returns them with every sample, and the version with `policy_versions`);
- `proximal`: the same tokens under the weights the trainer holds before this update (the
  version it is about to replace), without gradient;
- `log_probs`: under the weights being trained (with gradient).

The loss is `-w * min(r * A, clip(r, 1 - eps, 1 + eps) * A)`, token-averaged over `mask`, with
the importance weight `w = exp(proximal - behaviour)` (the correction for sampling by an older
policy) and the trust-region ratio `r = exp(log_probs - proximal)`. With one gradient step per
batch, `proximal` is `log_probs.detach()` and `r` is 1 in value. On-policy tokens have
`w = 1` up to the numerical difference between sampler and trainer. A token whose weight
exceeds `weight_cap` is left out of the loss (its sampler was too far from the trainer to
correct for), as AReaL does."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def importance_weights(
    proximal: torch.Tensor, behaviour: torch.Tensor, *, cap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`exp(proximal - behaviour)` without gradient, and the mask of weights within `cap`)."""
    weights = torch.exp(proximal.detach() - behaviour)
    within = torch.ones_like(weights, dtype=torch.bool) if cap is None else weights <= cap
    return weights, within


@dataclass
class DecoupledLoss:
    """The loss and what to log of it."""

    loss: torch.Tensor
    weights: torch.Tensor
    """The importance weight of every token (0 where masked or capped)."""
    clipped_fraction: float
    capped_tokens: int
    max_weight: float


def decoupled_ppo_loss(
    log_probs: torch.Tensor,
    proximal: torch.Tensor,
    behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    weight_cap: float | None = None,
) -> DecoupledLoss:
    """The token-mean decoupled PPO loss over `mask` (all arguments shaped alike, e.g.
    `[batch, tokens]`; `advantages` broadcast per token)."""
    mask = mask.bool()
    weights, within = importance_weights(proximal, behaviour, cap=weight_cap)
    counted = mask & within
    weights = torch.where(counted, weights, torch.zeros_like(weights))
    ratio = torch.exp(log_probs - proximal.detach())
    advantages = advantages.expand_as(ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip, 1 + clip) * advantages
    per_token = -weights * torch.minimum(unclipped, clipped)
    denominator = mask.sum().clamp(min=1)
    loss = per_token.where(counted, torch.zeros_like(per_token)).sum() / denominator
    was_clipped = (unclipped != clipped) & counted
    return DecoupledLoss(
        loss=loss,
        weights=weights,
        clipped_fraction=float(was_clipped.sum() / denominator),
        capped_tokens=int((mask & ~within).sum()),
        max_weight=float(weights.max()) if weights.numel() else 0.0,
    )
