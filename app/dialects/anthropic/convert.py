"""Anthropic's Messages shapes to and from the OpenAI chat route's, which samples, parses tool
calls and reasoning, and records trajectories for both: a message's blocks become the chat
messages the template renders (a tool result a tool message, a tool use the assistant's tool
call, thinking its reasoning), and the chat completion becomes a message of content blocks.

A tool call's arguments are kept as the model wrote them (`ToolArguments`): a later turn that
sends the same call back as a `tool_use` block (its `input` an object, as Anthropic's SDK
holds it) renders the text the model sampled, not a re-serialisation, so an agent's history
stays token-exact."""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError

from app.common.failures import Unsupported, invalid
from app.dialects.anthropic.protocol import (
    AnthropicMessage,
    AnthropicUsage,
    AssistantMessageParam,
    ContentOut,
    CountTokensRequest,
    MediaBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    StopReason,
    TextBlock,
    TextOut,
    ThinkingBlock,
    ThinkingOut,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    UserMessageParam,
)
from app.dialects.openai.answers import ChatChoice, ChatCompletion
from app.dialects.openai.protocol import ChatCompletionRequest

_KEPT_CALLS = 65_536
"""Tool calls whose arguments' exact text is kept (least recently answered go first)."""


class ToolArguments:
    """The exact text of the arguments of tool calls this server answered, by call id."""

    def __init__(self, size: int = _KEPT_CALLS) -> None:
        self.size = size
        self._texts: OrderedDict[str, str] = OrderedDict()

    def keep(self, call_id: str, text: str) -> None:
        self._texts[call_id] = text
        self._texts.move_to_end(call_id)
        while len(self._texts) > self.size:
            self._texts.popitem(last=False)

    def text_of(self, call_id: str, given: dict[str, Any]) -> str:
        """The arguments text to render for a call sent back with input `given`: the model's
        own text when it says the same, else `given` as JSON."""
        kept = self._texts.get(call_id)
        if kept is not None and _object(kept) == given:
            return kept
        return json.dumps(given, ensure_ascii=False)


def _object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def system_text(system: str | list[TextBlock] | None) -> str | None:
    if isinstance(system, list):
        return "".join(block.text for block in system)
    return system


def chat_messages(
    request: MessagesRequest | CountTokensRequest, arguments: ToolArguments
) -> list[dict[str, Any]]:
    """The chat messages the template renders for an Anthropic request."""
    messages: list[dict[str, Any]] = []
    if (system := system_text(request.system)) is not None:
        messages.append({"role": "system", "content": system})
    for index, message in enumerate(request.messages):
        messages += _converted(message, f"messages[{index}].content", arguments)
    return messages


def _converted(
    message: UserMessageParam | AssistantMessageParam, field: str, arguments: ToolArguments
) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant(message.content, field, arguments)]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    for index, block in enumerate(message.content):
        where = f"{field}[{index}]"
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if text:  # (text before a result: its own user turn, in order)
                out.append({"role": "user", "content": "".join(text)})
                text = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
        else:
            _refuse_block(block, where, "user")
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def _assistant(blocks: list[Any], field: str, arguments: ToolArguments) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    text, reasoning, calls = [], [], []
    for index, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # (nothing of it can be rendered)
        elif isinstance(block, ToolUseBlock):
            written = arguments.text_of(block.id, block.input)
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": written},
                }
            )
        else:
            _refuse_block(block, f"{field}[{index}]", "assistant")
    turn["content"] = "".join(text)
    if reasoning:
        turn["reasoning_content"] = "".join(reasoning)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _refuse_block(block: Any, where: str, role: str) -> None:
    if isinstance(block, MediaBlock):
        raise Unsupported(
            f"{where}: a {block.type} block (the served models read text only)", param=where
        )
    raise invalid(where, f"a {block.type} block is not in a {role} message's content")


def tools_and_choice(
    request: MessagesRequest | CountTokensRequest,
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """The chat route's tools and tool choice; a choice that forces a tool (`any`, `tool`)
    needs constrained decoding, which this server does not do: refused by name."""
    choice: ToolChoice | None = request.tool_choice
    if choice is not None and choice.type in ("any", "tool"):
        raise Unsupported(
            f"tool_choice: '{choice.type}' forces a tool call, which needs constrained "
            "decoding; use 'auto' (the model calls tools as its template teaches)",
            param="tool_choice",
        )
    if not request.tools:
        return None, None if choice is None else choice.type
    tools = [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                **({"description": tool.description} if tool.description else {}),
                "parameters": tool.input_schema,
            },
        }
        for tool in request.tools
    ]
    return tools, "auto" if choice is None else choice.type


def chat_request(
    request: MessagesRequest | CountTokensRequest,
    arguments: ToolArguments,
    *,
    max_tokens: int = 1,
) -> ChatCompletionRequest:
    """The chat route's request for `request` (a message to sample, or one to count)."""
    tools, choice = tools_and_choice(request)
    body: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages(request, arguments),
        "max_tokens": max_tokens,
        "tools": tools,
        "tool_choice": choice,
    }
    if request.thinking is not None and request.thinking.type != "adaptive":
        body["chat_template_kwargs"] = {"enable_thinking": request.thinking.type == "enabled"}
    if request.messages[-1].role == "assistant":  # Anthropic's prefill: continued
        body |= {"add_generation_prompt": False, "continue_final_message": True}
    if isinstance(request, MessagesRequest):
        body |= {
            "max_tokens": request.max_tokens,
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": 1.0 if request.top_p is None else request.top_p,
            "top_k": request.top_k,
            "stream": request.stream,
            "stream_options": {"include_usage": True} if request.stream else None,
            "seed": request.seed,
            "trajectory_id": request.trajectory_id,
            "return_token_ids": request.return_token_ids,
        }
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # (a value the Anthropic model let through)
        first = exc.errors()[0]
        raise invalid(".".join(str(p) for p in first["loc"]), first["msg"]) from None


def stop_of(
    choice: ChatChoice | dict[str, Any], stops: list[str] | None
) -> tuple[StopReason, str | None]:
    """The message's stop reason (and the stop sequence that ended it) for a chat choice's."""
    finish: str | None
    if isinstance(choice, ChatChoice):
        finish, matched = choice.finish_reason, choice.stop_reason
    else:
        finish, matched = choice.get("finish_reason"), choice.get("stop_reason")
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "abort":
        return "pause_turn", None
    if isinstance(matched, str) and stops and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's input: its arguments as an object (arguments that are not one: empty;
    the text the model wrote is still what a later turn renders)."""
    return _object(arguments) or {}


def message_of(
    completion: ChatCompletion, request: MessagesRequest, arguments: ToolArguments
) -> AnthropicMessage:
    """The message for a chat completion of one choice; its tool calls' arguments kept."""
    (choice,) = completion.choices
    reply = choice.message
    content: list[ContentOut] = []
    if reply.reasoning:
        content.append(ThinkingOut(thinking=reply.reasoning))
    if reply.content:
        content.append(TextOut(text=reply.content))
    for call in reply.tool_calls or []:
        arguments.keep(call.id, call.function.arguments)
        content.append(
            ToolUseOut(
                id=call.id, name=call.function.name, input=tool_input(call.function.arguments)
            )
        )
    stop_reason, stop_sequence = stop_of(choice, request.stop_sequences)
    usage = completion.usage
    return AnthropicMessage(
        id=f"msg_{completion.id.removeprefix('chatcmpl-')}",
        model=request.model,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=AnthropicUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens
        ),
        policy_version=completion.policy_version,
        trajectory_id=completion.trajectory_id,
        turn=completion.turn,
        prompt_token_ids=completion.prompt_token_ids,
        token_ids=choice.token_ids,
    )
