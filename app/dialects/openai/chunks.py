"""A stream's server-sent events, choice by choice: the opening chunk, each batch of tokens
(text, reasoning, tool calls and log-probs as far as they are final) and the closing chunks."""

from __future__ import annotations

from typing import Any

from app.common.text import IncrementalText
from app.dialects.openai.answers import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    FinishReason,
    ToolCallDelta,
)
from app.dialects.openai.protocol import ToolCall
from app.dialects.openai.replies import (
    Job,
    decoder_of,
    extensions_of,
    reasoning_of,
    reasoning_reader,
    usage_of,
    values_of,
)
from app.dialects.openai.streaming import Tokens, sse_event
from app.dialects.openai.tools import parse_tool_calls
from app.engine.types import Generation


class Chunks:
    """The chunks of one stream, choice by choice."""

    def __init__(self, job: Job, version: int) -> None:
        self.job = job
        self.texts = job.texts
        self.count = len(job.prompts) * job.n
        decode = decoder_of(job)
        self.text = [IncrementalText(decode, job.request.stops) for _ in range(self.count)]
        self.readers = [reasoning_reader(job) for _ in range(self.count)]
        self.version = version

    def _chunk(self, choices: list[Any], **extra: Any) -> str:
        job = self.job
        common: dict[str, Any] = {
            "created": job.created,
            "model": job.request.model,
            "policy_version": self.version,
            "trajectory_id": job.trajectory_id,
            **extra,
        }
        if job.kind == "chat":
            body: Any = ChatCompletionChunk(id=f"chatcmpl-{job.id}", choices=choices, **common)
        else:
            body = Completion(id=f"cmpl-{job.id}", choices=choices, **common)
        return sse_event(body.model_dump(mode="json", exclude_none=True))

    def opening(self) -> list[str]:
        if self.job.kind != "chat":
            return []
        extra = {}
        if self.job.request.return_token_ids:
            extra["prompt_token_ids"] = self.job.prompts[0].ids
        role = [
            ChatChunkChoice(index=k, delta=ChatDelta(role="assistant", content=""))
            for k in range(self.count)
        ]
        return [self._chunk(role, **extra)]

    def tokens(self, index: int, tokens: Tokens) -> list[str]:
        job = self.job
        text = self.text[index]
        held = job.tool_names is not None  # a reply may turn out to be a tool call: its text
        if held:  # is held to the end (its tokens and log-probs are not)
            text.ids += tokens.ids
            new = ""
        else:
            new = text.add(tokens.ids)
        reader = self.readers[index]
        reasoning = ""
        if reader is not None and new:
            reasoning, new = reader.feed(new)
        with_ids = job.request.return_token_ids
        if not new and not reasoning and job.logprobs is None and not with_ids:
            return []
        ids = tokens.ids if with_ids else None
        if job.kind == "chat":
            logprobs = None
            if job.logprobs is not None:
                logprobs = ChoiceLogprobs(
                    content=self.texts.chat_entries(
                        tokens.ids,
                        tokens.log_probs,
                        None,
                        as_ids=self.job.as_ids,
                    )
                )
            delta = ChatDelta(
                content=None if held or (reasoning and not new) else new,
                **reasoning_of(job, reader, reasoning),
            )
            choice: Any = ChatChunkChoice(
                index=index, delta=delta, logprobs=logprobs, token_ids=ids
            )
        else:
            completion_logprobs = None
            if job.logprobs is not None:
                completion_logprobs = self.texts.completion_logprobs(
                    tokens.ids,
                    tokens.log_probs,
                    None,
                    start=text.shown_length - len(new),
                    as_ids=job.as_ids,
                )
            choice = CompletionChoice(
                index=index, text=new, logprobs=completion_logprobs, token_ids=ids
            )
        return [self._chunk([choice])]

    def closing(self, generations: list[Generation], turn: int | None) -> list[str]:
        job = self.job
        lines = []
        for index, g in enumerate(generations):
            text = self.text[index]
            missing = g.token_ids[len(text.ids) :]  # tokens an engine did not stream
            if missing:
                lines += self.tokens(index, Tokens(missing, values_of(job, g)[len(text.ids) :]))
            finish: FinishReason = g.finish_reason
            reader = self.readers[index]
            if job.tool_names is not None:
                content: str | None = text.full_text()
                calls: list[ToolCall] = []
                if reader is not None:
                    reader.feed(content or "", last=True)
                    content = reader.result()[1]
                if content is not None:
                    content, calls = parse_tool_calls(content, job.tool_names)
                delta = ChatDelta(
                    content=content,
                    **reasoning_of(job, reader),
                    tool_calls=[
                        ToolCallDelta(index=i, id=c.id, type="function", function=c.function)
                        for i, c in enumerate(calls)
                    ]
                    or None,
                )
                finish = "tool_calls" if calls else finish
                lines.append(self._chunk([ChatChunkChoice(index=index, delta=delta)]))
            elif reader is not None:
                reasoning, rest = reader.feed(text.finish(), last=True)
                if reasoning or rest:
                    delta = ChatDelta(content=rest or None, **reasoning_of(job, reader, reasoning))
                    lines.append(self._chunk([ChatChunkChoice(index=index, delta=delta)]))
            elif rest := text.finish():
                if job.kind == "chat":
                    lines.append(
                        self._chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=rest))])
                    )
                else:
                    lines.append(self._chunk([CompletionChoice(index=index, text=rest)]))
            extensions = extensions_of(job, g)
            extensions.pop("token_ids", None)  # streamed with the tokens
            if job.kind == "chat":
                last: Any = ChatChunkChoice(
                    index=index, delta=ChatDelta(), finish_reason=finish, **extensions
                )
            else:
                last = CompletionChoice(index=index, text="", finish_reason=finish, **extensions)
            lines.append(self._chunk([last], turn=turn))
        if job.request.include_usage:
            lines.append(self._chunk([], usage=usage_of(job, generations)))
        return lines
