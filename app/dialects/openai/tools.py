"""Tool calls in generated text, in the form Hermes-style chat templates (Qwen and others, and
the built-in model's) teach: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

A call's `arguments` is the exact text the model wrote for them (its spacing, key order and
escapes), not a re-serialisation: sent back in the next turn, a template that writes string
arguments as they are (Qwen's, Hermes') renders the same tokens the model sampled."""

from __future__ import annotations

import json
import re
import uuid

from app.dialects.openai.protocol import FunctionCall, ToolCall

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_SPACE = re.compile(r"\s*")
_DECODER = json.JSONDecoder()


def object_members(text: str) -> dict[str, tuple[object, str]] | None:
    """A JSON object's members as (value, the value's exact text), or None if `text` is not
    one JSON object."""
    at = _SPACE.match(text).end()  # type: ignore[union-attr]
    if not text.startswith("{", at):
        return None
    members: dict[str, tuple[object, str]] = {}
    at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    try:
        if text.startswith("}", at):
            at += 1
        else:
            while True:
                key, at = _DECODER.raw_decode(text, at)
                at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
                if not isinstance(key, str) or not text.startswith(":", at):
                    return None
                start = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
                value, at = _DECODER.raw_decode(text, start)
                members[key] = (value, text[start:at])
                at = _SPACE.match(text, at).end()  # type: ignore[union-attr]
                if text.startswith("}", at):
                    at += 1
                    break
                if not text.startswith(",", at):
                    return None
                at = _SPACE.match(text, at + 1).end()  # type: ignore[union-attr]
    except ValueError:
        return None
    return members if not text[at:].strip() else None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None when nothing is left; the calls). A block that is
    not a JSON object with a known `name` stays in the text, as the model wrote it."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        members = object_members(match.group(1))
        if members is None or members.get("name", (None,))[0] not in names:
            return match.group(0)
        name = members["name"][0]
        value, written = members.get("arguments", ({}, "{}"))
        # arguments sent as a JSON string already hold the arguments' text
        arguments = value if isinstance(value, str) else written
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        calls.append(
            ToolCall(id=call_id, function=FunctionCall(name=str(name), arguments=arguments))
        )
        return ""

    rest = _CALL.sub(take, text).strip() if "<tool_call>" in text else text
    return (rest or None) if calls else text, calls
