"""`/inference/v1/generate`: vLLM's token-in, token-out generation, answered by rlserve's
generation service (the same tokens and log-probs as /v1/generate for the same seed)."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from app.common.dialect_models import (
    warn_ignored,
)
from app.common.routed_experts import npy_base64
from app.common.sampling import GenerationAsk, Names
from app.common.service import Resolved
from app.common.text import final_text
from app.dialects import common
from app.dialects.common import Prompts, policy_side, sample
from app.dialects.vllm.protocol import (
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    InferenceGenerateRequest,
    InferenceGenerateResponse,
    PromptLogProb,
    SamplingParams,
    TextLogProb,
    TextLogProbs,
    TextLogProbsContent,
    Usage,
    WeightVersionSpan,
)
from app.engine.types import Generation, Scores
from app.generation.service import GenerationService

FIELD = "sampling_params."


def resolve(
    generation: GenerationService,
    params: SamplingParams,
    model: str = "policy",
    prompts: Sequence[Sequence[int]] | None = None,
    *,
    routed_experts: bool = False,
) -> Resolved:
    """vLLM's sampling parameters as rlserve's ask, resolved against `model` (its vocabulary,
    the server's limits), naming the field of a refusal. vLLM's logprobs ask each chosen
    token's rank too, even for k = 0; `routed_experts`: the server's
    --enable-return-routed-experts."""
    names = Names(
        FIELD,
        {
            "max_new_tokens": FIELD + "max_tokens",
            "top_logprobs": FIELD + "logprobs",
            "prompt_top_logprobs": FIELD + "prompt_logprobs",
        },
    )
    ask = GenerationAsk(
        params.sampling_ask(),
        top_logprobs=params.logprobs or 0,
        ranks=params.logprobs is not None,
        prompt_top_logprobs=params.prompt_logprobs,
        routing_where_recorded=routed_experts,
        routing_start=params.routed_experts_prompt_start,
    )
    return generation.resolve(ask, model, names, prompts)


async def generate(
    generation: GenerationService,
    request: InferenceGenerateRequest,
    *,
    routed_experts: bool = False,
) -> InferenceGenerateResponse:
    """`routed_experts`: the server's --enable-return-routed-experts (each choice then carries
    a mixture-of-experts policy's routing)."""
    model = policy_side(generation.registry, request.model)
    warn_ignored("/inference/v1/generate", request.ignored())
    params = request.sampling_params
    token_ids = request.token_ids
    if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > 0:
        token_ids = token_ids[-params.truncate_prompt_tokens :]
    resolved = resolve(generation, params, model, [token_ids], routed_experts=routed_experts)
    backend = generation.served(model).backend
    routing = backend.routing if resolved.config.return_routed_experts else None
    k, prompt_k, start = params.logprobs, params.prompt_logprobs, params.routed_experts_prompt_start
    sampled = await sample(
        generation,
        Prompts(token_ids=[token_ids], field="token_ids"),
        resolved,
        n=params.n,
        seed=params.seed,
        model=model,
    )
    preparer = generation.served(model).preparer
    text_mode = request.output_mode == "text"

    def label(version: int) -> str:
        return common.label(generation.registry, version)

    def token_text(token: int) -> str:
        return str(preparer.decode([token]))

    choices = []
    for i, g in enumerate(sampled.generations):
        choice = _choice(i, g, sampled.scores_of(i), k, token_text if text_mode else None, label)
        if text_mode:
            text = preparer.decode(g.token_ids, skip_special=params.skip_special_tokens)
            choice.text = (
                text if params.include_stop_str_in_output else final_text(text, params.stops)
            )
        if g.routed_experts is not None and routing is not None:
            choice.routed_experts = npy_base64(g.routed_experts[start:], routing)
        choices.append(choice)
    prompt_logprobs = None
    if prompt_k is not None and sampled.prompt_scores and sampled.prompt_scores[0] is not None:
        prompt_logprobs = _prompt_logprobs(token_ids, sampled.prompt_scores[0], token_text)
    completion = sum(len(g.token_ids) for g in sampled.generations)
    prompt = len(token_ids)
    return InferenceGenerateResponse(
        request_id=request.request_id or uuid.uuid4().hex,
        model=request.model or "policy",
        created=int(time.time()),
        output_mode=request.output_mode,
        choices=choices,
        prompt_logprobs=prompt_logprobs,
        prompt_token_ids=token_ids if request.return_token_ids else None,
        usage=Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        ),
    )


def _choice(
    index: int,
    g: Generation,
    scores: Scores | None,
    k: int | None,
    text: Any,
    label: Callable[[int], str],
) -> GenerateChoice:
    """One choice; its log-probs as vLLM's tokens mode gives them (ids), or with `text` (a
    token's text) as its text mode does (OpenAI's entries, with bytes); its versions as
    `label` names them."""
    logprobs: GenerateLogProbs | TextLogProbs | None = None
    if k is not None and len(g.log_probs) == len(g.token_ids):
        rows = _rows(g, scores, max(k, 1))
        if text is None:
            logprobs = GenerateLogProbs(
                content=[
                    GenerateLogProbsContent(
                        token_id=token,
                        token=f"token_id:{token}",
                        logprob=value,
                        rank=rank,
                        top_logprobs=[
                            GenerateLogProb(token_id=t, token=f"token_id:{t}", logprob=v, rank=r)
                            for t, v, r in top
                        ],
                    )
                    for token, value, rank, top in rows
                ]
            )
        else:
            logprobs = TextLogProbs(
                content=[
                    TextLogProbsContent(
                        **_named(token, value, text),
                        top_logprobs=[TextLogProb(**_named(t, v, text)) for t, v, _ in top],
                    )
                    for token, value, _, top in rows
                ]
            )
    return GenerateChoice(
        index=index,
        finish_reason=g.finish_reason,
        stop_reason=g.stop_reason,
        token_ids=g.token_ids,
        logprobs=logprobs,
        weight_versions=[WeightVersionSpan.of(s, label) for s in g.versions]
        if g.versions
        else None,
    )


Entry = tuple[int, float, int | None]


def _rows(
    g: Generation, scores: Scores | None, keep: int
) -> list[tuple[int, float, int | None, list[Entry]]]:
    """Per generated token: its id, log-prob and rank, and its first `keep` entries as vLLM
    lists them (one per token id: the sampled token first, then the most likely in rank
    order)."""
    ranks = scores.ranks.tolist() if scores is not None and scores.ranks is not None else []
    top_ids = scores.top_ids.tolist() if scores is not None and scores.top_ids is not None else []
    top_values = (
        scores.top_log_probs.tolist()
        if scores is not None and scores.top_log_probs is not None
        else []
    )
    rows = []
    for t, (token, value) in enumerate(zip(g.token_ids, g.log_probs, strict=True)):
        rank = ranks[t] if t < len(ranks) else None
        top: dict[int, Entry] = {token: (token, value, rank)}
        if t < len(top_ids):
            for r, (i, v) in enumerate(zip(top_ids[t], top_values[t], strict=True)):
                top.setdefault(i, (i, v, r + 1))
        rows.append((token, value, rank, list(top.values())[:keep]))
    return rows


def _clamped(value: float) -> float:
    """vLLM's floor for a log-prob in its answers: -inf and NaN become -9999.0."""
    return -9999.0 if math.isnan(value) else max(value, -9999.0)


def _named(token: int, value: float, text: Any) -> dict[str, Any]:
    """OpenAI's entry fields: the token's text, its log-prob (-9999.0 for -inf, as vLLM
    clamps it) and its UTF-8 bytes."""
    name = text(token)
    return {
        "token": name,
        "logprob": _clamped(value),
        "bytes": list(name.encode("utf-8", "replace")),
    }


def _prompt_logprobs(
    ids: list[int], scores: Scores, text: Any
) -> list[dict[str, PromptLogProb] | None]:
    """vLLM's layout: null for the first token, then per token id its entry (the prompt's
    own token first, then the k most likely in order)."""
    own = scores.log_probs.tolist()
    ranks = scores.ranks.tolist() if scores.ranks is not None else []
    top_ids = scores.top_ids.tolist() if scores.top_ids is not None else [[] for _ in ranks]
    top_values = scores.top_log_probs.tolist() if scores.top_log_probs is not None else top_ids

    def entry(token: int, value: float, rank: int | None) -> PromptLogProb:
        return PromptLogProb(logprob=_clamped(value), rank=rank, decoded_token=text(token))

    out: list[dict[str, PromptLogProb] | None] = [None]
    for p in range(1, len(ids)):
        row = {str(ids[p]): entry(ids[p], own[p], ranks[p - 1] if p - 1 < len(ranks) else None)}
        for r, (token, value) in enumerate(zip(top_ids[p - 1], top_values[p - 1], strict=True)):
            row.setdefault(str(token), entry(token, value, r + 1))
        out.append(row)
    return out
