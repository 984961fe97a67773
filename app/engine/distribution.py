"""The math that answers a scoring call's asks of the next-token distribution at each position
(`ScoreSpec`, answered as `Scores`: both in `app.engine.types`) from logits. Both backends use
it: transformers on its own logits, vLLM on the full-vocabulary log-probs it returns (which are
logits up to a per-position constant)."""

from __future__ import annotations

import torch

from app.engine.sampling import filter_top_k_top_p
from app.engine.types import Scores, ScoreSpec

EXTRA_FIELDS = (
    "top_ids",
    "top_log_probs",
    "entropy",
    "processed",
    "truncated_mass",
    "candidates",
    "ranks",
)


def log_probs_of(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """log softmax(logits)[target] over the last dimension, as logit minus logsumexp: the one
    way rlserve takes a log-prob, when decoding and when scoring. (`log_softmax` rounds a
    confident token's log-prob up to 3e-4 away from float64 on a 151k vocabulary; this is
    within a few float32 ulps of it.) Logits [..., V] (float32) and targets [...] ->
    log-probs [...]; `lse`: the logits' logsumexp, where the caller has it already."""
    lse = logits.logsumexp(-1) if lse is None else lse
    return logits.gather(-1, targets[..., None]).squeeze(-1) - lse


def position_scores(
    logits: torch.Tensor, targets: torch.Tensor, spec: ScoreSpec, *, extras: bool
) -> dict[str, torch.Tensor]:
    """Logits [N, V] of N positions and their targets [N] -> "log_probs" [N] and, when
    `extras`, what `spec` asks for (the fields of `Scores`)."""
    logits = logits.float()
    lse = logits.logsumexp(-1)
    out = {"log_probs": log_probs_of(logits, targets, lse)}
    if not extras:
        return out
    if spec.top_logprobs:
        k = min(spec.top_logprobs, logits.shape[-1])
        values, ids = logits.topk(k, dim=-1)
        out["top_ids"], out["top_log_probs"] = ids, values - lse[:, None]
    if spec.entropy:
        p = (logits - lse[:, None]).exp()
        out["entropy"] = -torch.special.xlogy(p, p).sum(-1)
    if spec.ranks:
        chosen = logits.gather(-1, targets[:, None])
        out["ranks"] = (logits > chosen).sum(-1) + 1
    if spec.token_ids is not None:
        ids = torch.tensor(spec.token_ids, dtype=torch.long, device=logits.device)
        out["candidates"] = logits[:, ids] - lse[:, None]
    if spec.processed:
        scaled = logits / spec.temperature
        rows = logits.shape[0]
        kept = filter_top_k_top_p(
            scaled,
            torch.full((rows, 1), spec.top_k or 0, device=logits.device),
            torch.full((rows, 1), spec.top_p, device=logits.device),
        )
        kept_lse = kept.logsumexp(-1)
        out["processed"] = log_probs_of(kept, targets, kept_lse)
        out["truncated_mass"] = (1 - (kept_lse - scaled.logsumexp(-1)).exp()).clamp(min=0)
    return out


def assemble(parts: list[dict[str, torch.Tensor]], start: int, length: int) -> Scores:
    """One sequence's Scores from its position chunks (positions 1…length-1, in order; the
    extras of chunks before `start` are cut)."""
    raw = torch.cat([torch.zeros(1)] + [p["log_probs"].cpu() for p in parts])[:length]
    scores = Scores(log_probs=raw, start=start)
    offset = 1
    for part in parts:
        n = part["log_probs"].shape[0]
        skip = max(0, start - offset)
        for name in EXTRA_FIELDS:
            if name in part and skip < n:
                chunk = part[name][skip:].cpu()
                current = getattr(scores, name)
                setattr(scores, name, chunk if current is None else torch.cat([current, chunk]))
        offset += n
    return scores
