"""Wire models of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`):
the request as Anthropic's SDK sends it (a system prompt, content blocks of text, tool use,
tool results and thinking, tools with their input schemas, a tool choice, stop sequences),
and the message it answers. Fields this server cannot honour are refused by name; fields it
does not know are ignored and told (`X-Ignored-Fields`), as on the OpenAI routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from app.common.dialect_models import DialectModel, NullsKept, dialect_schema
from app.common.protocol import Seed, Temperature

Text = Annotated[str, Field(max_length=1 << 26)]


class TextBlock(DialectModel):
    model_config = ConfigDict(extra="allow")  # (cache_control, citations: accepted, unused)

    type: Literal["text"]
    text: Text


class MediaBlock(DialectModel):
    """Accepted by the model only to be refused by name (the served models read text); the
    published schema leaves it out (`_text_blocks_only`)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["image", "document", "search_result", "container_upload"]


class ToolUseBlock(DialectModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    input: dict[str, Any]


class ToolResultBlock(DialectModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: Text | list[TextBlock] | None = None
    is_error: bool | None = Field(
        default=None, description="Rendered as the result's text (the template has no flag)."
    )

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(block.text for block in self.content)
        return self.content or ""


class ThinkingBlock(DialectModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = Field(default=None, description="Accepted and ignored.")


class RedactedThinkingBlock(DialectModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["redacted_thinking"]


UserBlock = Annotated[TextBlock | ToolResultBlock | MediaBlock, Field(discriminator="type")]
AssistantBlock = Annotated[
    TextBlock | ToolUseBlock | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")
]


def _text_blocks_only(schema: dict[str, Any]) -> None:
    """The content blocks the schema offers: not the media blocks, which are refused."""
    for option in schema["properties"]["content"].get("anyOf", []):
        items = option.get("items")
        if items is None:
            continue
        items["oneOf"] = [r for r in items["oneOf"] if "MediaBlock" not in r["$ref"]]
        mapping = items.get("discriminator", {}).get("mapping", {})
        for tag in [t for t, ref in mapping.items() if "MediaBlock" in ref]:
            del mapping[tag]


class UserMessageParam(DialectModel):
    """A user turn: text, and the results of the tools the assistant called."""

    model_config = ConfigDict(
        title="UserMessageParam", json_schema_extra=dialect_schema(_text_blocks_only)
    )

    role: Literal["user"]
    content: Text | list[UserBlock]


class AssistantMessageParam(DialectModel):
    """An assistant turn: text, tool calls and thinking."""

    role: Literal["assistant"]
    content: Text | list[AssistantBlock]


MessageParam = Annotated[UserMessageParam | AssistantMessageParam, Field(discriminator="role")]


class ToolDefinition(DialectModel):
    model_config = ConfigDict(extra="allow")  # (cache_control: accepted, unused)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="The JSON schema of the tool's input.")
    type: Literal["custom"] | None = Field(
        default=None, description="A custom tool (Anthropic's server tools are not served)."
    )


class ToolChoice(DialectModel):
    type: Literal["auto", "any", "tool", "none"] = Field(
        description="auto or none: any and tool (forcing a call, which needs constrained "
        "decoding) are refused by name.",
        json_schema_extra={"enum": ["auto", "none"]},
    )
    name: str | None = None
    disable_parallel_tool_use: bool | None = Field(
        default=None, description="Accepted: the model calls as many tools as it writes."
    )


class ThinkingConfig(DialectModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(
        default=None, ge=0, description="Accepted: thinking ends where the model ends it."
    )


class Metadata(DialectModel):
    model_config = ConfigDict(extra="allow")

    user_id: str | None = Field(default=None, max_length=256, description="Accepted, unused.")


class MessagesRequest(DialectModel):
    """Anthropic's Messages request. The prompt is the served model's chat template over the
    system prompt and the messages (a tool result is a tool message, a tool use the assistant
    turn's tool call, a thinking block its reasoning); a last assistant message is continued
    (Anthropic's prefill)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(
        min_length=1,
        max_length=4096,
        description="A served name (GET /v1/models): 'policy', an alias, or a LoRA adapter.",
    )
    max_tokens: int = Field(ge=1, description="The most tokens the reply may sample.")
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=100_000)]
    system: Text | list[TextBlock] | None = None
    stop_sequences: (
        Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None
    ) = None
    temperature: Temperature = None
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1 << 30)
    stream: bool = False
    tools: Annotated[list[ToolDefinition], Field(max_length=1024)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = Field(
        default=None,
        description="enabled or disabled: the template's enable_thinking (Qwen3's); unset: "
        "the template's default.",
    )
    metadata: Metadata | None = None
    # RL extensions, off by default (the SDK sends them in `extra_body`)
    seed: Seed | None = Field(default=None, description="Extension: the reply's random stream.")
    trajectory_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Extension: records the reply as the next turn of this trajectory (also "
        "the X-Trajectory-ID header), as the OpenAI routes do.",
    )
    return_token_ids: bool = Field(
        default=False,
        description="Extension: the prompt as templated and the sampled token ids.",
    )


class CountTokensRequest(DialectModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=4096)
    messages: Annotated[list[MessageParam], Field(min_length=1, max_length=100_000)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=1024)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountedTokens(DialectModel):
    input_tokens: int = Field(description="The prompt's tokens, as the template renders it.")


# -- the answer ------------------------------------------------------------------------------


class TextOut(DialectModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(DialectModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = Field(default="", description="Always empty: nothing is signed here.")


class ToolUseOut(DialectModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ThinkingOut | ToolUseOut, Field(discriminator="type")]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn"]


class AnthropicUsage(DialectModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessage(NullsKept):
    kept_null = ("stop_sequence",)

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = Field(
        description="end_turn, max_tokens, stop_sequence, tool_use; pause_turn: a pause of "
        "the server's weights ('abort') ended it early (send it back to go on)."
    )
    stop_sequence: str | None = None
    usage: AnthropicUsage
    # rlserve's extensions
    policy_version: int = Field(description="Extension: the policy version it started on.")
    trajectory_id: str | None = None
    turn: int | None = Field(default=None, description="Extension: its turn in the trajectory.")
    prompt_token_ids: list[int] | None = Field(
        default=None, description="Extension (return_token_ids): the prompt as templated."
    )
    token_ids: list[int] | None = Field(
        default=None, description="Extension (return_token_ids): every sampled token."
    )


class AnthropicErrorDetail(DialectModel):
    type: str
    message: str


class AnthropicError(DialectModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
