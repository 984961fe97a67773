"""Anthropic's Messages API over the OpenAI chat route's job: the same template, sampling,
tool-call parser, reasoning parser and trajectory recording (so an agent whose harness mixes
the two SDKs in one `X-Trajectory-ID` session gives one trajectory), answered as Anthropic's
message or as its server-sent events."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from app.dialects.anthropic.convert import (
    ToolArguments,
    chat_request,
    message_of,
    stop_of,
    tool_input,
)
from app.dialects.anthropic.protocol import (
    AnthropicMessage,
    CountedTokens,
    CountTokensRequest,
    MessagesRequest,
)
from app.dialects.openai.answers import ChatCompletion
from app.dialects.openai.replies import Job
from app.dialects.openai.service import OpenAIService


class AnthropicService:
    def __init__(self, openai: OpenAIService) -> None:
        self.openai = openai
        self.arguments = ToolArguments()
        """The exact text of the tool calls answered here (`convert.ToolArguments`)."""

    async def job(self, request: MessagesRequest, owner: str, trajectory_id: str | None) -> Job:
        chat = chat_request(request, self.arguments)
        return await self.openai.chat_job(chat, owner, trajectory_id)

    async def message(self, job: Job, request: MessagesRequest) -> AnthropicMessage:
        completion = await self.openai.complete(job)
        assert isinstance(completion, ChatCompletion)
        return message_of(completion, request, self.arguments)

    async def count_tokens(self, request: CountTokensRequest, owner: str) -> CountedTokens:
        """The prompt's tokens as a message request would template them (nothing sampled)."""
        job = await self.openai.chat_job(chat_request(request, self.arguments), owner, None)
        return CountedTokens(input_tokens=len(job.prompts[0].ids))

    async def stream(self, job: Job, request: MessagesRequest) -> AsyncIterator[str]:
        """Start sampling (a failure until it is admitted is an ordinary error reply); then
        Anthropic's events, translated from the chat route's chunks as they come."""
        chunks = await self.openai.open_stream(job)
        return Events(job, request, self.arguments).translate(chunks)


def event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body})}\n\n"


class Events:
    """One stream's events: `message_start`, each content block's start, deltas and stop
    (thinking, text, then each tool use), `message_delta` with the stop reason and the usage,
    and `message_stop`."""

    def __init__(self, job: Job, request: MessagesRequest, arguments: ToolArguments) -> None:
        self.job, self.request, self.arguments = job, request, arguments
        self.index = -1
        self.open: str | None = None  # the kind of the block open now
        self.token_ids: list[int] = []  # (return_token_ids: said at the end)

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        lines = self._stop()
        self.index += 1
        self.open = kind
        return [*lines, event("content_block_start", {"index": self.index, "content_block": block})]

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", {"index": self.index, "delta": delta})

    def _text(self, kind: str, text: str) -> list[str]:
        lines: list[str] = []
        if self.open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""}
            lines += self._start(
                kind, empty if kind == "thinking" else {"type": "text", "text": ""}
            )
        if kind == "thinking":
            return [*lines, self._delta({"type": "thinking_delta", "thinking": text})]
        return [*lines, self._delta({"type": "text_delta", "text": text})]

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        job = self.job
        start: dict[str, Any] = {
            "id": f"msg_{job.id}",
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(job.prompts[0].ids), "output_tokens": 0},
        }
        opened = False
        finish: dict[str, Any] | None = None
        output_tokens = 0
        async for line in chunks:
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if not opened:
                start |= {"policy_version": chunk.get("policy_version")}
                start |= {"trajectory_id": chunk.get("trajectory_id")}
                if "prompt_token_ids" in chunk:
                    start["prompt_token_ids"] = chunk["prompt_token_ids"]
                yield event("message_start", {"message": start})
                opened = True
            if (usage := chunk.get("usage")) is not None:
                output_tokens = usage["completion_tokens"]
            for choice in chunk.get("choices", []):
                for out in self._choice(choice):
                    yield out
                if choice.get("finish_reason") is not None:
                    finish = choice | {"turn": chunk.get("turn")}
        for out in self._stop():
            yield out
        stop_reason, stop_sequence = stop_of(finish or {}, self.request.stop_sequences)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        extra: dict[str, Any] = {}
        if finish is not None and finish.get("turn") is not None:
            extra["turn"] = finish["turn"]
        if self.request.return_token_ids:
            extra["token_ids"] = self.token_ids
        usage = {"output_tokens": output_tokens}
        yield event("message_delta", {"delta": delta, "usage": usage, **extra})
        yield event("message_stop", {})

    def _choice(self, choice: dict[str, Any]) -> list[str]:
        delta = choice.get("delta") or {}
        lines: list[str] = []
        if reasoning := delta.get("reasoning") or delta.get("reasoning_content"):
            lines += self._text("thinking", reasoning)
        if content := delta.get("content"):
            lines += self._text("text", content)
        self.token_ids += choice.get("token_ids") or []
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            self.arguments.keep(call["id"], function["arguments"])
            block = {"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}}
            lines += self._start("tool_use", block)
            partial = json.dumps(tool_input(function["arguments"]), ensure_ascii=False)
            lines.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
            lines += self._stop()
        return lines
