"""What a scoring call can ask of the next-token distribution at each position, and the math
that answers it from logits. Both backends use it: transformers on its own logits, vLLM on the
full-vocabulary log-probs it returns (which are logits up to a per-position constant)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.engine.sampling import filter_top_k_top_p


@dataclass(frozen=True)
class ScoreSpec:
    """A scoring call's asks beyond the raw log-prob of each token. The extras cover the
    positions from `start` on (position p: the prediction of token p from tokens < p)."""

    top_logprobs: int = 0
    entropy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    token_ids: tuple[int, ...] | None = None
    ranks: bool = False
    """Each token's rank in the raw distribution (1: the most likely), as vLLM reports it."""
    start: int = 1

    @property
    def processed(self) -> bool:
        """Log-probs under the temperature-scaled, top-k/top-p truncated distribution."""
        return self.temperature != 1.0 or bool(self.top_k) or self.top_p < 1.0

    @property
    def needs_full_distribution(self) -> bool:
        """Whether the whole vocabulary is needed (top-k alone is not: engines return it)."""
        return self.entropy or self.processed or self.token_ids is not None or self.ranks

    @property
    def ranked_top_k(self) -> bool:
        """Whether an engine's own top-k and ranks answer it (vLLM's prompt log-probs)."""
        return not (self.entropy or self.processed or self.token_ids is not None)

    @property
    def extras(self) -> bool:
        return self.top_logprobs > 0 or self.needs_full_distribution


@dataclass
class Scores:
    """One sequence's answers. `log_probs` covers every position (0.0 at position 0); the
    extras cover positions `start`… (one row per position), None when not asked."""

    log_probs: torch.Tensor
    start: int = 1
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    processed: torch.Tensor | None = None
    """-inf where top-k/top-p removed the token."""
    truncated_mass: torch.Tensor | None = None
    """Probability mass (of the temperature-scaled distribution) that top-k/top-p removed."""
    candidates: torch.Tensor | None = None
    """[positions, len(token_ids)] log-probs of the requested ids."""
    ranks: torch.Tensor | None = None
    """Each token's rank: 1 + how many tokens the raw distribution finds more likely."""


EXTRA_FIELDS = (
    "top_ids",
    "top_log_probs",
    "entropy",
    "processed",
    "truncated_mass",
    "candidates",
    "ranks",
)


def position_scores(
    logits: torch.Tensor, targets: torch.Tensor, spec: ScoreSpec, *, extras: bool
) -> dict[str, torch.Tensor]:
    """Logits [N, V] of N positions and their targets [N] -> "log_probs" [N] and, when
    `extras`, what `spec` asks for (the fields of `Scores`)."""
    logits = logits.float()
    lse = logits.logsumexp(-1)
    out = {"log_probs": logits.gather(-1, targets[:, None]).squeeze(-1) - lse}
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
        out["processed"] = kept.gather(-1, targets[:, None]).squeeze(-1) - kept_lse
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
