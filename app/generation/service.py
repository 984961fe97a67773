"""Generation: sample continuations of prompts given as messages, text or tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rlserve_client.sequences import SequenceSplit

from app.common.containers import HistoryFields, TextFields, wire_spans
from app.common.inputs import InputPreparer, Prepared
from app.common.samples import log_prob_fields, mask_fields, messages, token_fields
from app.common.service import ModelServing, Resolved
from app.engine.abandon import Abandonment
from app.engine.base import ScoreItem
from app.engine.sampling import row_seed
from app.engine.served import ServedModel
from app.engine.types import GenerateItem, Generation, Scores, ScoreSpec, TokenSink
from app.generation.protocol import (
    GeneratedSample,
    GenerateRequest,
    GenerateResponse,
)
from app.scoring.extras import extras


@dataclass
class Sampled:
    """Generations of prepared prompts, `n` per prompt (adjacent), on one policy version."""

    version: int
    prompts: list[Prepared]
    generations: list[Generation]
    scores: list[Scores | None] | None = None
    """Per generation, what the request asked beyond log-probs, over its response; None for
    a row an abort ended (see `scores_of`)."""
    prompt_scores: list[Scores | None] | None = None
    """Per prompt, what the request asked of the prompt itself (`prompt_asks`); None for a
    prompt whose generation was aborted before the engine scored it."""

    def scores_of(self, k: int) -> Scores | None:
        """Generation k's extras: None when none were asked, or an abort ended the row."""
        return None if self.scores is None else self.scores[k]


class GenerationService(ModelServing):
    async def sample(
        self,
        model: str,
        prompts: list[Prepared],
        resolved: Resolved,
        *,
        n: int = 1,
        seed: int | None = None,
        sinks: Sequence[TokenSink] | None = None,
        started: asyncio.Future[int] | None = None,
    ) -> Sampled:
        """The domain API: checked prompts and a resolved ask (`ModelServing.resolve`) in, `n`
        generations each out. Row k's random stream is `row_seed(seed, k)`, whatever else is
        batched with it. With `resolved.asks`, each finished sequence is also scored for them
        over its response, under the weights at its end; with `resolved.prompt_asks`, each
        prompt is scored for them too. Row k's tokens also go to `sinks[k]` as they are sampled
        (streaming), and `started` gets the policy version once generation is admitted.
        `resolved.alone` (batch-invariant mode): every row and every scoring pass in a model
        call of its own, and each finished row's log-probs those of one scoring pass over its
        tokens."""
        served = self.registry.get(model)
        config, asks, prompt_asks = resolved.config, resolved.asks, resolved.prompt_asks
        alone = served.invariant if resolved.alone is None else resolved.alone
        abandoned = Abandonment()
        # An engine that scores prompts as it generates (top-k and ranks) does so for each
        # prompt's first row.
        capable = served.backend.capabilities.prompt_scores
        in_pass = prompt_asks if prompt_asks and prompt_asks.ranked_top_k and capable else None
        items = [
            GenerateItem(
                tuple(p.ids),
                config,
                row_seed(seed, i * n + j),
                abandoned,
                sinks[i * n + j] if sinks is not None else None,
                prompt_asks=in_pass if j == 0 else None,
            )
            for i, p in enumerate(prompts)
            for j in range(n)
        ]
        try:
            async with self.registry.generating(served, abandoned) as admitted:
                version = self.registry.answered(served, admitted)
                if started is not None and not started.done():
                    started.set_result(version)
                prompt_scores: list[Scores | None] | None = None
                if prompt_asks is not None and in_pass is None:
                    # Scored first: an engine with a prefix cache then generates from it.
                    work = served.score_detailed(
                        [(p.ids, prompt_asks) for p in prompts], alone=alone
                    )
                    first = await self.registry.unless_aborted(work)
                    if first is None:  # an abort pause began: nothing is generated
                        aborted = [Generation([], [], None, "abort") for _ in items]
                        return Sampled(version, prompts, aborted, None, [None] * len(prompts))
                    prompt_scores = list(first)
                generations = await served.generate(items, alone=alone)
                if alone:
                    await self._rescore_alone(served, items, generations)
                if in_pass is not None:
                    # (Not scored again when missing: an aborted row is missing them, and
                    # while an abort pause holds, the engine admits no new request.)
                    prompt_scores = [g.prompt_scores for g in generations[::n]]
                scores = None
                if asks is not None:
                    scores = await self._score_finished(
                        served, items, generations, asks, alone=alone
                    )
        except asyncio.CancelledError:
            abandoned.set()  # the backend stops these rows at the next token
            raise
        return Sampled(version, prompts, generations, scores, prompt_scores)

    async def _score_finished(
        self,
        served: ServedModel,
        items: list[GenerateItem],
        generations: list[Generation],
        asks: ScoreSpec,
        *,
        alone: bool = False,
    ) -> list[Scores | None]:
        """`asks` over each finished row's response, in one call. Rows an abort ended are not
        scored. An abort pause that begins first cancels the call (the pause waits for this
        request, and a paused engine would not score before the resume): the rows then end
        "abort" too, with their tokens and without the extras."""
        rows = [k for k, g in enumerate(generations) if g.finish_reason != "abort"]
        scores: list[Scores | None] = [None] * len(generations)
        if not rows:
            return scores
        work = served.score_detailed(
            _finished([items[k] for k in rows], [generations[k] for k in rows], asks),
            alone=alone,
        )
        scored = await self.registry.unless_aborted(work)
        for j, k in enumerate(rows):
            if scored is None:
                generations[k].finish_reason = "abort"
            else:
                scores[k] = scored[j]
        return scores

    async def _rescore_alone(
        self, served: ServedModel, items: list[GenerateItem], generations: list[Generation]
    ) -> None:
        """Batch-invariant log-probs: each finished row's raw log-probs (and its prompt's,
        when asked) from one scoring pass over its tokens alone, the pass /v1/logprobs runs,
        instead of the decoding steps' (within about 1e-5 in float32, not bitwise). Only for a row
        that ran on one version that is still served before and after the pass: a row that
        spans an update keeps the log-probs it was sampled with."""
        rows = [k for k, g in enumerate(generations) if g.finish_reason != "abort"]
        if not rows:
            return
        before = self.registry.version_of(served)
        # A row whose routing was recorded is scored with it replayed: its log-probs are then
        # those of the experts its routed_experts name.
        work = served.score_detailed(
            [
                (
                    items[k].prompt_ids + tuple(generations[k].token_ids),
                    ScoreSpec(routed_experts=generations[k].routed_experts),
                )
                for k in rows
            ],
            alone=True,
        )
        scored = await self.registry.unless_aborted(work)
        if scored is None or self.registry.version_of(served) != before:
            return
        for k, scores in zip(rows, scored, strict=True):
            full = scores.log_probs.tolist()
            generation = generations[k]
            spans = generation.versions
            if spans is not None and (len(spans) != 1 or spans[0].version != before):
                continue
            num_prompt = len(items[k].prompt_ids)
            generation.log_probs = full[num_prompt:]
            if generation.prompt_log_probs is not None:
                generation.prompt_log_probs = full[:num_prompt]

    async def sample_tokens(
        self,
        prompts: list[list[int]],
        resolved: Resolved,
        *,
        seed: int | None = None,
        model: str = "policy",
    ) -> Sampled:
        """One generation of the policy (or of `model`, one of its adapters) per token prompt
        (env observations), checked as `tokens`."""
        preparer = self.registry.get(model).preparer
        prepared = preparer.prompts(None, None, prompts, "tokens")
        preparer.check(prepared, "tokens", max_new_tokens=resolved.config.max_new_tokens)
        return await self.sample(model, prepared, resolved, seed=seed)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        ask, names = request.generation_ask()
        max_new_tokens = self.max_new_tokens(ask.sampling.max_new_tokens, names("max_new_tokens"))
        inputs = await self.prompts(
            request, request.model, max_new_tokens=max_new_tokens, per_item=request.num_samples
        )
        resolved = self.resolve(ask, request.model, names, [p.ids for p in inputs.items])
        sampled = await self.sample(
            request.model, inputs.items, resolved, n=request.num_samples, seed=request.seed
        )
        preparer = inputs.preparer
        outputs = await preparer.off_loop(
            _generated_samples, sampled, preparer, request, resolved.asks
        )
        return GenerateResponse(
            policy_version=sampled.version,
            model=request.model,
            pad_token_id=preparer.pad_token_id,
            outputs=outputs,
        )


def _finished(
    items: list[GenerateItem], generations: list[Generation], asks: ScoreSpec
) -> list[ScoreItem]:
    """Each finished sequence with `asks` over its response."""
    return [
        (
            [*item.prompt_ids, *g.token_ids],
            # the routing the row was sampled with, where it was recorded
            replace(asks, start=len(item.prompt_ids), routed_experts=g.routed_experts),
        )
        for item, g in zip(items, generations, strict=True)
    ]


def _generated_samples(
    sampled: Sampled,
    preparer: InputPreparer,
    request: GenerateRequest,
    asked: ScoreSpec | None,
) -> list[list[GeneratedSample]]:
    """Each prompt's samples, decoded (on the tokenizer thread), with the extras `asked`."""
    n = request.num_samples
    out = []
    for i, prompt in enumerate(sampled.prompts):
        group = []
        for k in range(i * n, (i + 1) * n):
            sample = generated_sample(
                prompt,
                sampled.generations[k],
                preparer,
                with_log_probs=request.wants_log_probs,
                skip_special_tokens=request.skip_special_tokens,
            )
            scores = sampled.scores_of(k)
            if scores is not None and asked is not None:
                sample = sample.model_copy(update=extras(scores, asked, len(prompt.ids)))
            group.append(sample)
        out.append(group)
    return out


def generated_sample(
    prompt: Prepared,
    generation: Generation,
    preparer: InputPreparer,
    *,
    with_log_probs: bool,
    skip_special_tokens: bool,
) -> GeneratedSample:
    """One generated sample in TorchRL's layout."""
    response = generation.token_ids
    split = SequenceSplit.generated(prompt.ids, response)
    log_probs = None
    if with_log_probs:
        log_probs = log_prob_fields(
            split.log_prob_parts(
                response=generation.log_probs,
                prompt=generation.prompt_log_probs,
                response_processed=generation.processed_log_probs,
            )
        )
    history = None
    if prompt.history is not None:
        content = preparer.decode(response, skip_special=True)
        reply = [{"role": "assistant", "content": content}]
        history = HistoryFields(
            prompt=messages(prompt.history),
            response=messages(reply),
            full=messages(prompt.history + reply),
        )
    return GeneratedSample(
        text=TextFields(
            prompt=preparer.decode(prompt.ids),
            response=preparer.decode(response, skip_special=skip_special_tokens),
            full=preparer.decode(split.ids),
        ),
        tokens=token_fields(split.token_parts()),
        masks=mask_fields(split.mask_parts()),
        log_probs=log_probs,
        history=history,
        finish_reason=generation.finish_reason,
        stop_reason=generation.stop_reason,
        policy_versions=wire_spans(generation.versions),
        routed_experts=(
            None if generation.routed_experts is None else generation.routed_experts.tolist()
        ),
    )
