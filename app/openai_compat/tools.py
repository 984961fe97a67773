"""Tool calls in generated text, in the form Hermes-style chat templates (Qwen and others, and
the built-in model's) teach: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import re
import uuid

from app.openai_compat.protocol import FunctionCall, ToolCall

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(the text outside the calls, or None when nothing is left; the calls). A block that is
    not JSON with a known `name` stays in the text, as the model wrote it."""
    calls: list[ToolCall] = []

    def take(match: re.Match[str]) -> str:
        try:
            body = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not isinstance(body, dict) or body.get("name") not in names:
            return match.group(0)
        arguments = body.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        calls.append(
            ToolCall(id=call_id, function=FunctionCall(name=body["name"], arguments=arguments))
        )
        return ""

    rest = _CALL.sub(take, text).strip() if "<tool_call>" in text else text
    return (rest or None) if calls else text, calls
