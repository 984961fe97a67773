"""vLLM's render and derender routes. Render: a chat or completion request as the
`/inference/v1/generate` body that samples it (its prompt's token ids and its sampling
parameters). Derender: that route's answer read back as the chat or completion reply. Both go
through the OpenAI routes' own preparation and reply building, so a rendered prompt is token
for token the one `/v1/chat/completions` samples, and a derendered reply is the one it
answers for the same tokens."""

from __future__ import annotations

import math

from app.common.failures import invalid
from app.common.protocol import top_k_or_none
from app.dialects.openai.answers import ChatCompletion, Completion
from app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.dialects.openai.replies import Job
from app.dialects.openai.service import OpenAIService
from app.dialects.openai.tokens import Tops
from app.dialects.vllm.protocol import (
    DerenderChatRequest,
    DerenderCompletionRequest,
    GenerateLogProbs,
    RenderedRequest,
    SamplingParams,
    TextLogProbs,
    TokensAnswer,
    WeightVersionSpan,
)
from app.engine.registry import ModelRegistry
from app.engine.types import MAX_VERSION, Generation, VersionSpan
from app.generation.service import Sampled


def sampling_params(job: Job) -> SamplingParams:
    """The job's sampling as vLLM's SamplingParams: what `/inference/v1/generate` turns back
    into the same `SamplingConfig` (the server's default length made explicit)."""
    request = job.request
    # OpenAI's top_p 0 keeps the most likely token alone, which vLLM's sampling (top_p in
    # (0, 1]) says as top_k 1: the same token from the same random stream.
    top_p, top_k = request.top_p, top_k_or_none(request.top_k) or 0
    if top_p == 0:
        top_p, top_k = 1.0, 1
    return SamplingParams(
        n=request.n,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=request.stops or None,
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        max_tokens=job.config.max_new_tokens,
        min_tokens=request.min_tokens,
        logprobs=job.logprobs,
        prompt_logprobs=getattr(request, "prompt_logprobs", None),
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias={int(k): v for k, v in request.logit_bias.items()}
        if request.logit_bias
        else None,
        allowed_token_ids=request.allowed_token_ids,
        bad_words=request.bad_words,
    )


def _check_renderable(request: ChatCompletionRequest | CompletionRequest, prefix: str = "") -> None:
    if request.trajectory_id is not None:
        raise invalid(
            f"{prefix}trajectory_id",
            "a trajectory records sampled turns: render has none to record",
        )


def _rendered(job: Job, index: int, request_id: str) -> RenderedRequest:
    request = job.request
    extra = request.model_extra or {}
    return RenderedRequest(
        request_id=request_id,
        token_ids=job.prompts[index].ids,
        sampling_params=sampling_params(job),
        model=request.model,
        stream=request.stream,
        priority=extra.get("priority", 0),
        cache_salt=extra.get("cache_salt"),
    )


async def render_chat(
    openai: OpenAIService, request: ChatCompletionRequest, owner: str
) -> RenderedRequest:
    _check_renderable(request)
    job = await openai.chat_job(request, owner, None)
    return _rendered(job, 0, f"chatcmpl-{job.id}")


async def render_completion(
    openai: OpenAIService, request: CompletionRequest, owner: str
) -> list[RenderedRequest]:
    _check_renderable(request)
    job = await openai.completion_job(request, owner, None)
    many = len(job.prompts) > 1
    return [
        _rendered(job, i, f"cmpl-{job.id}-{i}" if many else f"cmpl-{job.id}")
        for i in range(len(job.prompts))
    ]


def _generations(
    registry: ModelRegistry, job: Job, response: TokensAnswer, field: str
) -> tuple[list[Generation], list[Tops]]:
    """One prompt's answer as the generations (and their most likely tokens) it sampled."""
    if len(response.choices) != job.n:
        given = len(response.choices)
        raise invalid(f"{field}.choices", f"{given} entries for {job.n} (the request's n)")
    generations, tops = [], []
    vocabulary = job.served.preparer.check_vocabulary
    for k, choice in enumerate(sorted(response.choices, key=lambda c: c.index)):
        where = f"{field}.choices[{k}]"
        vocabulary(choice.token_ids, f"{where}.token_ids")
        if isinstance(choice.logprobs, TextLogProbs) and choice.logprobs.content:
            raise invalid(f"{where}.logprobs", "a tokens answer's entries carry token_id")
        content = choice.logprobs.content if isinstance(choice.logprobs, GenerateLogProbs) else None
        if job.logprobs is not None and content is None:
            raise invalid(f"{where}.logprobs", "the request asks for log-probs: send them")
        if content is not None and len(content) != len(choice.token_ids):
            given = len(content)
            raise invalid(
                f"{where}.logprobs", f"{given} entries for {len(choice.token_ids)} tokens"
            )
        for t, entry in enumerate(content or []):
            named = [entry.token_id, *(top.token_id for top in entry.top_logprobs)]
            vocabulary(named, f"{where}.logprobs.content[{t}]")
            logprobs = [entry.logprob, *(top.logprob for top in entry.top_logprobs)]
            if not all(math.isfinite(v) for v in logprobs):
                raise invalid(f"{where}.logprobs.content[{t}]", "holds NaN or infinite values")
        values = [entry.logprob for entry in content] if content is not None else []
        generations.append(
            Generation(
                token_ids=choice.token_ids,
                log_probs=values,
                processed_log_probs=values if job.processed else None,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                versions=_spans(registry, choice.weight_versions, f"{where}.weight_versions"),
            )
        )
        tops.append(
            [[(t.token_id, t.logprob) for t in e.top_logprobs] for e in content]
            if job.logprobs and content is not None
            else None
        )
    return generations, tops


def _spans(
    registry: ModelRegistry, spans: list[WeightVersionSpan] | None, field: str
) -> list[VersionSpan] | None:
    """The answer's weight versions (as /inference/v1/generate names them: the trainer's
    count, read in the current lineage) as rlserve's."""
    out = []
    for i, span in enumerate(spans or []):
        text = span.version
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_VERSION:
            raise invalid(f"{field}[{i}].version", f"'{text}' is not a policy version")
        out.append(VersionSpan(registry.gate.unlabel("policy", int(text)), span.start, span.end))
    return out or None


def _version(openai: OpenAIService, generations: list[Generation]) -> int:
    """The newest weights that sampled any token (the served version when none is said)."""
    spans = [span.version for g in generations for span in g.versions or []]
    return max(spans) if spans else openai.registry.policy_version


def _check_derenderable(request: ChatCompletionRequest | CompletionRequest, prefix: str) -> None:
    _check_renderable(request, prefix)
    if request.stream:
        raise invalid(f"{prefix}stream", "only unstreamed replies are derendered")


async def _reply(
    openai: OpenAIService, job: Job, generations: list[Generation], tops: list[Tops]
) -> ChatCompletion | Completion:
    """The OpenAI route's reply to `job` for these generations."""
    sampled = Sampled(_version(openai, generations), job.prompts, generations)
    return await job.served.preparer.off_loop(openai.reply, job, sampled, None, tops)


async def derender_chat(
    openai: OpenAIService, body: DerenderChatRequest, owner: str
) -> ChatCompletion:
    _check_derenderable(body.chat_request, "chat_request.")
    job = await openai.chat_job(body.chat_request, owner, None)
    generations, tops = _generations(
        openai.registry, job, body.generate_response, "generate_response"
    )
    reply = await _reply(openai, job, generations, tops)
    assert isinstance(reply, ChatCompletion)
    return reply


async def derender_completion(
    openai: OpenAIService, body: DerenderCompletionRequest, owner: str
) -> Completion:
    request = body.completion_request
    _check_derenderable(request, "completion_request.")
    if request.echo or request.prompt_logprobs is not None:
        field = "echo" if request.echo else "prompt_logprobs"
        raise invalid(f"completion_request.{field}", "the prompt's scores are not derendered")
    job = await openai.completion_job(request, owner, None)
    if len(body.generate_responses) != len(job.prompts):
        raise invalid(
            "generate_responses",
            f"{len(body.generate_responses)} entries for {len(job.prompts)} prompts",
        )
    generations, tops = [], []
    for i, response in enumerate(body.generate_responses):
        more, more_tops = _generations(openai.registry, job, response, f"generate_responses[{i}]")
        generations += more
        tops += more_tops
    reply = await _reply(openai, job, generations, tops)
    assert isinstance(reply, Completion)
    return reply
