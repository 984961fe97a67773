"""`/inference/v1/generate`: vLLM's token-in, token-out generation, answered by rlserve's
generation service (the same tokens and log-probs as /v1/generate for the same seed)."""

from __future__ import annotations

import time
import uuid

from app.common.failures import invalid
from app.common.protocol import top_k_or_none
from app.dialects.common import Prompts, sample
from app.dialects.vllm.protocol import (
    GenerateChoice,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    InferenceGenerateRequest,
    InferenceGenerateResponse,
    Usage,
    WeightVersionSpan,
)
from app.engine.types import Generation, SamplingConfig, Scores, ScoreSpec
from app.generation.serving import GenerationService


async def generate(
    generation: GenerationService, request: InferenceGenerateRequest
) -> InferenceGenerateResponse:
    params = request.sampling_params
    max_new = generation.max_new_tokens(params.max_tokens, "sampling_params.max_tokens")
    config = SamplingConfig.resolve(
        max_new,
        greedy=params.temperature == 0,
        temperature=params.temperature,
        stops=params.stops,
        top_p=params.top_p,
        top_k=top_k_or_none(params.top_k),
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        ignore_eos=params.ignore_eos,
    )
    k = params.logprobs
    if k is not None and k > generation.limits.max_top_logprobs:
        raise invalid(
            "sampling_params.logprobs",
            f"at most {generation.limits.max_top_logprobs} (the server's max_top_logprobs)",
        )
    asks = ScoreSpec(top_logprobs=k, ranks=True) if k is not None else None
    prompts = Prompts(token_ids=[request.token_ids], field="token_ids")
    sampled = await sample(generation, prompts, config, n=params.n, seed=params.seed, asks=asks)
    choices = [_choice(i, g, sampled.scores_of(i), k) for i, g in enumerate(sampled.generations)]
    completion = sum(len(g.token_ids) for g in sampled.generations)
    prompt = len(request.token_ids)
    return InferenceGenerateResponse(
        request_id=request.request_id or uuid.uuid4().hex,
        model="policy",
        created=int(time.time()),
        choices=choices,
        prompt_token_ids=request.token_ids if request.return_token_ids else None,
        usage=Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        ),
    )


def _choice(index: int, g: Generation, scores: Scores | None, k: int | None) -> GenerateChoice:
    logprobs = None
    if k is not None and len(g.log_probs) == len(g.token_ids):
        ranks = scores.ranks.tolist() if scores is not None and scores.ranks is not None else []
        top_ids = (
            scores.top_ids.tolist() if scores is not None and scores.top_ids is not None else []
        )
        top_values = (
            scores.top_log_probs.tolist()
            if scores is not None and scores.top_log_probs is not None
            else []
        )
        content = []
        for t, (token, value) in enumerate(zip(g.token_ids, g.log_probs, strict=True)):
            rank = ranks[t] if t < len(ranks) else None
            top = [GenerateLogProb(token_id=token, logprob=value, rank=rank)]
            if t < len(top_ids):
                top += [
                    GenerateLogProb(token_id=i, logprob=v, rank=r + 1)
                    for r, (i, v) in enumerate(zip(top_ids[t], top_values[t], strict=True))
                ]
            content.append(
                GenerateLogProbsContent(token_id=token, logprob=value, rank=rank, top_logprobs=top)
            )
        logprobs = GenerateLogProbs(content=content)
    return GenerateChoice(
        index=index,
        finish_reason=g.finish_reason,
        stop_reason=g.stop_reason,
        token_ids=g.token_ids,
        logprobs=logprobs,
        weight_versions=[WeightVersionSpan.of(s) for s in g.versions] if g.versions else None,
    )
