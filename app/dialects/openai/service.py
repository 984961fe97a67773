"""The OpenAI-compatible routes' logic. An OpenAI request becomes the sampling call
/v1/generate makes (same batcher, backends and per-row seeds, so the same seed gives the same
tokens on both), its reply takes OpenAI's shape, and a completion made in a trajectory is
recorded token-exactly (the prompt as templated, every sampled token, raw log-probs,
versions)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from app.common.dialect_models import (
    warn_ignored,
)
from app.common.failures import invalid
from app.common.inputs import Prepared, naming, text_volume
from app.common.sampling import GenerationAsk, Names
from app.common.service import ModelServing
from app.config_groups import LimitSettings, ReasoningParser
from app.dialects.openai.answers import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
)
from app.dialects.openai.chunks import Chunks
from app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from app.dialects.openai.replies import (
    ROUTES,
    Job,
    Kind,
    chat_message,
    echoed_scores,
    echoes,
    extensions_of,
    prompt_logprobs_of,
    reasoning_of,
    reply_text,
    usage_of,
    values_of,
)
from app.dialects.openai.streaming import Tokens, TokenStream
from app.dialects.openai.tokens import TokenTexts, Tops
from app.engine.registry import ModelRegistry
from app.engine.served import ServedModel
from app.engine.types import Generation, Scores
from app.generation.service import GenerationService, Sampled
from app.scoring.extras import extras
from app.trajectories.service import TrajectoryService


class OpenAIService(ModelServing):
    def __init__(
        self,
        registry: ModelRegistry,
        generation: GenerationService,
        trajectories: TrajectoryService,
        limits: LimitSettings,
        reasoning_parser: ReasoningParser | None = None,
        *,
        routed_experts: bool = False,
        tokens_as_ids: bool = False,
    ) -> None:
        """`routed_experts`: vLLM's --enable-return-routed-experts (each choice of a
        mixture-of-experts policy carries its routing); `tokens_as_ids`: its
        --return-tokens-as-token-ids (log-probs name tokens 'token_id:<id>' unless a request
        says otherwise)."""
        super().__init__(registry, limits)
        self.generation = generation
        self.reasoning_parser = reasoning_parser
        self.routed_experts = routed_experts
        self.tokens_as_ids = tokens_as_ids
        self.trajectories = trajectories
        self._texts: dict[str, TokenTexts] = {}

    # -- checking ----------------------------------------------------------------------

    def served(self, name: str) -> ServedModel:
        """The model named in the request; OpenAI answers an unknown one with 404."""
        return self.registry.get(name)

    async def chat_job(
        self, request: ChatCompletionRequest, owner: str, trajectory_id: str | None
    ) -> Job:
        served = self.served(request.model)
        preparer = served.preparer
        if not preparer.has_chat_template:
            raise invalid("messages", "this model's tokenizer has no chat template")
        tools = None
        if request.tools and request.tool_choice != "none":
            if not preparer.supports_tools:
                raise invalid("tools", "this model's chat template does not render tools")
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
        messages = [m.for_template() for m in request.messages]
        max_new = self.max_new_tokens(
            request.max_new_tokens,
            "max_completion_tokens" if request.max_completion_tokens else "max_tokens",
        )

        def prepare() -> Prepared:
            with naming("messages"):
                return preparer.template(
                    messages,
                    generation_prompt=request.add_generation_prompt,
                    tools=tools,
                    options=request.template_options(),
                )

        prompt = await preparer.off_loop(prepare, cost=text_volume(messages) + text_volume(tools))
        preparer.check([prompt], "messages", max_new_tokens=max_new)
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
        names = {tool["function"]["name"] for tool in tools} if tools else None
        job = self._job(
            "chat", served, [prompt], request, max_new, logprobs, names, owner, trajectory_id
        )
        if request.separate_reasoning:
            job.reasoning = self.reasoning_parser
        job.show_reasoning = request.include_reasoning
        return job

    async def completion_job(
        self, request: CompletionRequest, owner: str, trajectory_id: str | None
    ) -> Job:
        served = self.served(request.model)
        preparer = served.preparer
        max_new = self.max_new_tokens(request.max_tokens, "max_tokens")
        texts, token_lists = request.prompts()

        def prepare() -> list[Prepared]:
            prepared = preparer.prompts(None, texts, token_lists, "prompt")
            preparer.check(prepared, "prompt", max_new_tokens=max_new)
            return prepared

        prompts = await preparer.off_loop(prepare, cost=text_volume(texts))
        return self._job(
            "completion",
            served,
            prompts,
            request,
            max_new,
            request.logprobs,
            None,
            owner,
            trajectory_id,
        )

    def _job(
        self,
        kind: Kind,
        served: ServedModel,
        prompts: list[Prepared],
        request: SamplingFields,
        max_new: int,
        logprobs: int | None,
        tool_names: set[str] | None,
        owner: str,
        trajectory_id: str | None,
    ) -> Job:
        self.check_num_items(len(prompts) * request.n, "n")
        warn_ignored(ROUTES[kind], request.model_extra or {})
        top_field = "top_logprobs" if kind == "chat" else "logprobs"
        capabilities = served.backend.capabilities
        if request.logprobs_mode == "processed" and not capabilities.processed_log_probs:
            raise invalid(
                "logprobs_mode",
                "this server's engine reports raw log-probs only "
                "(vLLM: start it with RLSERVE_VLLM__PROCESSED_LOG_PROBS=true)",
            )
        if request.stream and logprobs:
            raise invalid(
                top_field, "the most likely tokens come after generation: not with stream"
            )
        streamed = capabilities.streamed_log_probs
        if request.stream and logprobs is not None and request.logprobs_mode != streamed:
            raise invalid(
                "logprobs_mode",
                f"this engine streams {streamed} log-probs; ask for those or do not stream",
            )
        trajectory_id = request.trajectory_id or trajectory_id
        if trajectory_id is not None and len(prompts) * request.n != 1:
            raise invalid("n", "a completion recorded in a trajectory has one prompt and n = 1")
        prompt_logprobs = getattr(request, "prompt_logprobs", None)
        if prompt_logprobs is not None and request.stream:
            raise invalid("prompt_logprobs", "is not streamed: ask without stream")
        # vLLM's prompt_logprobs: each prompt token's raw log-prob and rank, and the k most
        # likely tokens at each position; an echo with logprobs shows the prompt's too.
        prompt_k = prompt_logprobs
        if getattr(request, "echo", False) and logprobs is not None:
            prompt_k = max(prompt_k or 0, logprobs)
        ask = GenerationAsk(
            request.sampling_ask(max_new),
            top_logprobs=logprobs or 0,
            prompt_top_logprobs=prompt_k,
            routing_where_recorded=self.routed_experts,
            routing_start=request.routed_experts_prompt_start,
        )
        names = Names(renamed={"top_logprobs": top_field, "prompt_top_logprobs": "prompt_logprobs"})
        resolved = self.resolve(ask, request.model, names, [p.ids for p in prompts])
        engine = served.backend.info.name  # an adapter shares its base's tokenizer
        texts = self._texts.setdefault(engine, TokenTexts(served.preparer))
        if texts.preparer is not served.preparer:  # the model was reloaded
            texts = self._texts[engine] = TokenTexts(served.preparer)
        as_ids = request.return_tokens_as_token_ids
        return Job(
            kind,
            self.registry.name_of(served),
            served,
            prompts,
            resolved,
            request,
            logprobs,
            tool_names,
            trajectory_id,
            owner,
            texts,
            as_ids=self.tokens_as_ids if as_ids is None else as_ids,
        )

    # -- replies -----------------------------------------------------------------------

    async def complete(self, job: Job) -> ChatCompletion | Completion:
        await self._check_trajectory(job)
        sampled = await self.generation.sample(
            job.model, job.prompts, job.resolved, n=job.n, seed=job.request.seed
        )
        turn = await self._record(job, sampled)
        return await job.served.preparer.off_loop(self.reply, job, sampled, turn)

    def reply(
        self, job: Job, sampled: Sampled, turn: int | None, tops: list[Tops] | None = None
    ) -> ChatCompletion | Completion:
        """The reply to `job` for what was sampled; `tops`: each generation's most likely
        tokens where they come from elsewhere (derendering), else from `sampled`'s scores."""
        generations = sampled.generations
        usage = usage_of(job, generations)
        common: dict[str, Any] = {
            "created": job.created,
            "model": job.request.model,
            "usage": usage,
            "policy_version": sampled.version,
            "trajectory_id": job.trajectory_id,
            "turn": turn,
        }
        if job.request.return_token_ids and job.kind == "chat":
            common["prompt_token_ids"] = job.prompts[0].ids
        if tops is None:
            tops = [self._tops(job, sampled, k) for k in range(len(generations))]
        if job.kind == "chat":
            choices = [self._chat_choice(job, k, g, tops[k]) for k, g in enumerate(generations)]
            return ChatCompletion(id=f"chatcmpl-{job.id}", choices=choices, **common)
        prompt_scores = sampled.prompt_scores or [None] * len(job.prompts)
        completion_choices = [
            self._completion_choice(job, k, g, tops[k], prompt_scores[k // job.n])
            for k, g in enumerate(generations)
        ]
        asked = getattr(job.request, "prompt_logprobs", None)
        if sampled.prompt_scores is not None and asked is not None:
            prompt_logprobs = [  # (null for a prompt aborted before it was scored)
                None if s is None else prompt_logprobs_of(job, p.ids, s, asked)
                for p, s in zip(job.prompts, sampled.prompt_scores, strict=True)
            ]
            for choice in completion_choices:
                choice.prompt_logprobs = prompt_logprobs[choice.index // job.n]
        return Completion(id=f"cmpl-{job.id}", choices=completion_choices, **common)

    def _tops(self, job: Job, sampled: Sampled, k: int) -> list[list[tuple[int, float]]] | None:
        """Per generated token, the most likely (id, log-prob) pairs (when asked)."""
        scores, asks = sampled.scores_of(k), job.resolved.asks
        if asks is None or scores is None:
            return None
        table = extras(scores, asks, len(job.prompt_of(k).ids), tensors=True)
        ids, values = (
            table["top_logprobs"]["ids"].tolist(),
            table["top_logprobs"]["log_probs"].tolist(),
        )
        return [list(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]

    def _chat_choice(
        self,
        job: Job,
        index: int,
        g: Generation,
        tops: list[list[tuple[int, float]]] | None,
    ) -> ChatChoice:
        content, calls, reader = chat_message(job, g)
        logprobs = None
        if job.logprobs is not None:
            entries = job.texts.chat_entries(
                g.token_ids, values_of(job, g), tops, as_ids=job.as_ids
            )
            logprobs = ChoiceLogprobs(content=entries)
        return ChatChoice(
            index=index,
            message=AssistantMessage(
                content=content, tool_calls=calls or None, **reasoning_of(job, reader)
            ),
            logprobs=logprobs,
            finish_reason="tool_calls" if calls else g.finish_reason,
            **extensions_of(job, g),
        )

    def _completion_choice(
        self,
        job: Job,
        index: int,
        g: Generation,
        tops: list[list[tuple[int, float]]] | None,
        prompt_scores: Scores | None,
    ) -> CompletionChoice:
        text = reply_text(job, g)
        echoed = ""
        if echoes(job):
            prompt = job.prompt_of(index)
            echoed = prompt.text or job.served.preparer.decode(prompt.ids, skip_special=True)
        logprobs = None
        if job.logprobs is not None:
            as_ids = job.as_ids
            logprobs = job.texts.completion_logprobs(
                g.token_ids, values_of(job, g), tops, start=len(echoed), as_ids=as_ids
            )
            if echoes(job):
                ids = job.prompt_of(index).ids
                values, prompt_tops = echoed_scores(ids, prompt_scores, job.logprobs)
                shown = job.texts.completion_logprobs(ids, values, prompt_tops, as_ids=as_ids)
                shown.top_logprobs = [
                    None if v is None else row
                    for row, v in zip(shown.top_logprobs or [], values, strict=True)
                ]
                logprobs = CompletionLogprobs(
                    tokens=shown.tokens + logprobs.tokens,
                    token_logprobs=shown.token_logprobs + logprobs.token_logprobs,
                    top_logprobs=(shown.top_logprobs or []) + (logprobs.top_logprobs or []),
                    text_offset=shown.text_offset + logprobs.text_offset,
                )
        text = echoed + text
        extensions = extensions_of(job, g)
        if job.request.return_token_ids:
            extensions["prompt_token_ids"] = job.prompt_of(index).ids
        return CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=g.finish_reason, **extensions
        )

    async def _check_trajectory(self, job: Job) -> None:
        if job.trajectory_id is not None:
            await self.trajectories.check_writable(job.trajectory_id, job.owner)

    async def _record(self, job: Job, sampled: Sampled) -> int | None:
        if job.trajectory_id is None:
            return None
        (generation,) = sampled.generations
        if generation.finish_reason == "abort":
            return None  # nothing was completed: the caller will ask again
        finish: str = generation.finish_reason
        if job.kind == "chat" and job.tool_names is not None:  # the reply's own reason
            _, calls, _ = await job.served.preparer.off_loop(chat_message, job, generation)
            finish = "tool_calls" if calls else finish
        return await self.trajectories.record(
            job.trajectory_id,
            job.owner,
            job.model,
            job.prompts[0].ids,
            generation,
            job.served.backend.routing,
            finish_reason=finish,
        )

    # -- streaming ---------------------------------------------------------------------

    async def open_stream(self, job: Job) -> AsyncIterator[str]:
        """Start sampling and wait until it is admitted (a failure until then is an ordinary
        error reply); then the server-sent events: OpenAI's chunks as tokens are sampled, and
        `[DONE]` (added by the route, which also turns a failure after the start into an
        `error` event in OpenAI's error shape)."""
        await self._check_trajectory(job)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[int, Tokens]] = asyncio.Queue()
        sinks = [TokenStream(loop, queue, k) for k in range(len(job.prompts) * job.n)]
        started: asyncio.Future[int] = loop.create_future()
        task = asyncio.create_task(
            self.generation.sample(
                job.model,
                job.prompts,
                job.resolved,
                n=job.n,
                seed=job.request.seed,
                sinks=sinks,
                started=started,
            )
        )
        try:
            waiting: list[asyncio.Future[Any]] = [task, started]
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if not started.done():
                task.result()  # it failed before it was admitted: raise that
        except BaseException:
            await _stop(task)
            raise
        return self._events(job, task, queue, started.result())

    async def _events(
        self,
        job: Job,
        task: asyncio.Task[Sampled],
        queue: asyncio.Queue[tuple[int, Tokens]],
        version: int,
    ) -> AsyncIterator[str]:
        chunks = Chunks(job, version)
        try:
            for line in chunks.opening():
                yield line
            while True:
                getting = asyncio.ensure_future(queue.get())
                await asyncio.wait({getting, task}, return_when=asyncio.FIRST_COMPLETED)
                if not getting.done():
                    getting.cancel()
                    break
                index, tokens = getting.result()
                for line in chunks.tokens(index, tokens):
                    yield line
            while not queue.empty():
                index, tokens = queue.get_nowait()
                for line in chunks.tokens(index, tokens):
                    yield line
            sampled = task.result()
            turn = await self._record(job, sampled)
            # The whole text's one decode (and tool-call parsing) off the event loop.
            preparer = job.served.preparer
            for line in await preparer.off_loop(chunks.closing, sampled.generations, turn):
                yield line
        finally:
            await _stop(task)  # a client that went away: its rows stop at their next token


async def _stop(task: asyncio.Task[Sampled]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
