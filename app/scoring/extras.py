"""A scored sequence's extras as the wire carries them: one row per token of the span, null
where there is nothing to report (no prediction for a sequence's first token, or a token the
processed distribution removed), and the mismatch report against given log-probs."""

from __future__ import annotations

import math
from typing import Any

import torch

from app.common.protocol import WireModel
from app.engine.types import Scores, ScoreSpec
from app.scoring.protocol import MismatchReport, ProcessedLogProbs, TopLogProbs


def _rows(values: torch.Tensor | None, missing: int) -> list[Any]:
    """`missing` nulls, then the rows; -inf becomes null (JSON has no infinities)."""
    if values is None:
        return [None] * missing
    listed = values.tolist()
    if values.is_floating_point() and not bool(torch.isfinite(values).all()):
        listed = _finite_or_none(listed)
    return [None] * missing + listed


def _finite_or_none(rows: list[Any]) -> list[Any]:
    return [
        _finite_or_none(r) if isinstance(r, list) else (r if math.isfinite(r) else None)
        for r in rows
    ]


def _tensor_rows(values: torch.Tensor | None, missing: int) -> torch.Tensor:
    """`missing` rows of NaN (floats) or -1 (ids), then the rows (binary replies)."""
    if values is None:
        return torch.full((missing,), math.nan)
    if not missing:
        return values
    fill = math.nan if values.is_floating_point() else -1
    pad = torch.full((missing, *values.shape[1:]), fill, dtype=values.dtype)
    return torch.cat([pad, values])


def extras(
    scores: Scores, spec: ScoreSpec, span_start: int, *, tensors: bool = False
) -> dict[str, Any]:
    """The ScoredSample fields `spec` asks for, over positions span_start… : wire models of
    lists, or with `tensors` plain dicts of tensors (for the binary reply)."""
    missing = max(0, scores.start - span_start)
    rows = _tensor_rows if tensors else _rows

    def group(model: type[WireModel], **values: Any) -> Any:
        return values if tensors else model(**values)

    fields: dict[str, Any] = {}
    if spec.top_logprobs:
        fields["top_logprobs"] = group(
            TopLogProbs,
            ids=rows(scores.top_ids, missing),
            log_probs=rows(scores.top_log_probs, missing),
        )
    if spec.entropy:
        fields["entropy"] = rows(scores.entropy, missing)
    if spec.processed:
        fields["processed"] = group(
            ProcessedLogProbs,
            log_probs=rows(scores.processed, missing),
            truncated_mass=rows(scores.truncated_mass, missing),
        )
    if spec.token_ids is not None:
        fields["token_id_log_probs"] = rows(scores.candidates, missing)
    return fields


def mismatch(
    ours: list[float], reference: list[float], threshold: float, first_predicted: int
) -> MismatchReport:
    """`ours` against `reference` (both over the span); the first `first_predicted` tokens
    have no prediction and count nowhere."""
    difference: list[float | None] = [None] * first_predicted + [
        a - b for a, b in zip(ours[first_predicted:], reference[first_predicted:], strict=True)
    ]
    d = torch.tensor([x for x in difference if x is not None], dtype=torch.float64)
    n = d.numel()
    if n == 0:
        return MismatchReport(
            difference=difference,
            max_abs=0.0,
            mean_abs=0.0,
            effective_sample_size=0.0,
            num_tokens=0,
            num_beyond_threshold=0,
            threshold=threshold,
        )
    # (Σw)² / Σw² with w = exp(d), in log space so large differences do not overflow.
    ess = math.exp(float(2 * d.logsumexp(0) - (2 * d).logsumexp(0)))
    return MismatchReport(
        difference=difference,
        max_abs=float(d.abs().max()),
        mean_abs=float(d.abs().mean()),
        effective_sample_size=ess,
        num_tokens=n,
        num_beyond_threshold=int((d.abs() > threshold).sum()),
        threshold=threshold,
    )
