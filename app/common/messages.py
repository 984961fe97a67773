"""Chat messages as a chat template takes them: wire messages as plain dicts, a request's
template options, tool-call arguments as objects."""

from __future__ import annotations

import json
from typing import Any

from app.common.masks import Conversation


def plain_messages(conversation: Any) -> Conversation:
    """Wire messages as the template takes them, as the chat route gives them: an assistant
    turn's reasoning (`reasoning_content`, or vLLM's `reasoning`) and tool calls, a tool
    message's call id and name."""
    out: Conversation = []
    for m in conversation:
        content = m.content or getattr(m, "refusal", None) or ""
        message: dict[str, Any] = {"role": m.role, "content": content}
        reasoning = getattr(m, "reasoning", None)  # (vLLM's name wins, as on the chat route)
        if reasoning is None:
            reasoning = getattr(m, "reasoning_content", None)
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        for key in ("name", "tool_call_id"):
            if (value := getattr(m, key, None)) is not None:
                message[key] = value
        if calls := getattr(m, "tool_calls", None):
            message["tool_calls"] = [call.model_dump() for call in calls]
        out.append(message)
    return out


RESERVED_TEMPLATE_NAMES = ("add_generation_prompt", "tools", "conversation", "messages")
"""Template variables rlserve sets itself: a request's chat_template_kwargs cannot."""


def template_kwargs(given: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's chat_template_kwargs as its template gets them."""
    options = {k: v for k, v in (given or {}).items() if k not in RESERVED_TEMPLATE_NAMES}
    return options or None


def arguments_as_object(call: Any) -> Any:
    """A tool call whose arguments text (JSON) is the object it encodes."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    arguments = function["arguments"]
    try:
        value = json.loads(arguments)
    except ValueError:
        return call  # not JSON: the template gets the text
    return {**call, "function": {**function, "arguments": value}}
