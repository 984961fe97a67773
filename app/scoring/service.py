"""Scoring: the log-probability of every token of given sequences, and on request more about
the next-token distribution at each position of a span (top-k, entropy, processed log-probs,
candidate ids) and a mismatch report against given log-probs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from app.common.failures import TooLarge, invalid
from app.common.inputs import Prepared
from app.common.protocol import WireModel
from app.common.routed_experts import replay_rows, routing_of
from app.common.samples import scored_sample
from app.common.service import ModelServing
from app.engine.base import Backend
from app.engine.types import ScoreSpec
from app.scoring.extras import extras, mismatch
from app.scoring.protocol import LogProbsRequest, LogProbsResponse, ScoredSample, Span


class ScoringService(ModelServing):
    async def score(
        self, request: LogProbsRequest, *, tensors: bool = False
    ) -> LogProbsResponse | dict[str, Any]:
        """The response; with `tensors`, as a body for the binary reply, whose per-position
        extras stay tensors (never Python lists)."""
        self._check_asks(request, self.served(request.model).backend.info.vocab_size)
        inputs = await self.sequences(request, request.model)
        served, field, prepared, preparer = (
            inputs.served,
            inputs.field,
            inputs.items,
            inputs.preparer,
        )
        spans = [_span(request, item) for item in prepared]
        _check_reference(request, prepared, spans)
        asks = _asks(request)
        _check_full_distribution(asks, prepared, served.backend.full_distribution_limit())
        replay = _replay(request, served.backend, [len(item.ids) for item in prepared])
        specs = [
            replace(asks, start=max(1, start), routed_experts=routed)
            for (_, start), routed in zip(spans, replay, strict=True)
        ]
        detailed = asks.extras
        alone = self.alone(request.batch_invariant, served)
        async with self.registry.reading(served) as version:
            if detailed or any(r is not None for r in replay):
                scores = await served.score_detailed(
                    [(item.ids, spec) for item, spec in zip(prepared, specs, strict=True)],
                    alone=alone,
                )
                values = [s.log_probs.tolist() for s in scores]
            else:
                values = await served.score([item.ids for item in prepared], alone=alone)
        with_text = field != "tokens" and field != "prompt_tokens"

        def build(i: int) -> ScoredSample | dict[str, Any]:
            sample = scored_sample(prepared[i], values[i], preparer, with_text=with_text)
            span, start = spans[i]
            fields: dict[str, Any] = {}
            if detailed:
                fields = {"span": span, **extras(scores[i], specs[i], start, tensors=tensors)}
            if request.reference_log_probs is not None:
                fields["mismatch"] = mismatch(
                    values[i][start:],
                    request.reference_log_probs[i],
                    request.mismatch_threshold,
                    first_predicted=1 if start == 0 else 0,
                )
            if tensors:
                tree = sample.model_dump(exclude_none=True)
                return tree | {k: _plain(v) for k, v in fields.items()}
            return ScoredSample(**dict(sample)).model_copy(update=fields)

        outputs = await preparer.off_loop(lambda: [build(i) for i in range(len(prepared))])
        head: dict[str, Any] = {
            "policy_version": self.registry.answered(served, version),
            "model": request.model,
            "pad_token_id": served.preparer.pad_token_id,
        }
        if tensors:
            return {**head, "outputs": outputs}
        return LogProbsResponse.model_validate({**head, "outputs": outputs})

    def _check_asks(self, request: LogProbsRequest, vocab_size: int) -> None:
        self.top_logprobs(request.top_logprobs, "top_logprobs")
        if request.token_ids is not None:
            if len(request.token_ids) > self.limits.max_candidate_ids:
                raise invalid(
                    "token_ids",
                    f"at most {self.limits.max_candidate_ids} ids "
                    "(RLSERVE_LIMITS__MAX_CANDIDATE_IDS)",
                )
            for j, token in enumerate(request.token_ids):
                if token >= vocab_size:
                    raise invalid(
                        f"token_ids[{j}]", f"{token} is outside the vocabulary [0, {vocab_size})"
                    )


def _replay(
    request: LogProbsRequest, backend: Backend, lengths: list[int]
) -> list[torch.Tensor | None]:
    """Per input, the routing the request gives to replay (None: the routers choose)."""
    if request.routed_experts is None:
        return [None] * len(lengths)
    routing = routing_of(backend, request.model, "routed_experts")
    return replay_rows(routing, request.routed_experts, lengths, "routed_experts")


def _plain(value: Any) -> Any:
    return value.model_dump(exclude_none=True) if isinstance(value, WireModel) else value


def _asks(request: LogProbsRequest) -> ScoreSpec:
    """What the request asks of every position (each input's span sets its own start)."""
    return ScoreSpec(
        top_logprobs=request.top_logprobs,
        entropy=request.entropy,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p,
        token_ids=tuple(request.token_ids) if request.token_ids is not None else None,
    )


def _span(request: LogProbsRequest, item: Prepared) -> tuple[Span, int]:
    """The span the extras cover and its first position in the full sequence."""
    split = item.split()
    span = request.span or ("response" if split.response is not None else "full")
    if span == "full":
        return span, 0
    if split.prompt is None or split.response is None:
        raise invalid("span", "'response' needs inputs split into prompt and response")
    return span, len(split.prompt)


def _check_full_distribution(spec: ScoreSpec, prepared: list[Prepared], limit: int | None) -> None:
    if limit is None or not spec.needs_full_distribution:
        return
    field = "entropy" if spec.entropy else "token_ids" if spec.token_ids else "temperature"
    for i, item in enumerate(prepared):
        if len(item.ids) > limit:
            raise TooLarge(
                f"input {i} has {len(item.ids)} tokens; {field} needs the whole vocabulary at "
                f"every position, which this backend scores for at most {limit} tokens per "
                "sequence (top_logprobs alone has no such bound)",
                param=field,
            )


def _check_reference(
    request: LogProbsRequest, prepared: list[Prepared], spans: list[tuple[Span, int]]
) -> None:
    given = request.reference_log_probs
    if given is None:
        return
    if len(given) != len(prepared):
        raise invalid("reference_log_probs", f"{len(given)} lists for {len(prepared)} inputs")
    for i, (item, (span, start)) in enumerate(zip(prepared, spans, strict=True)):
        expected = len(item.ids) - start
        if len(given[i]) != expected:
            raise invalid(
                f"reference_log_probs[{i}]",
                f"{len(given[i])} values for the {expected} tokens of the {span} span",
            )
