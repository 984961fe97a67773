"""Wire models of the OpenAI-compatible routes' answers: completions and chat completions, their
stream's chunks, log-probs and usage, with rlserve's RL extensions (`policy_version`,
`token_ids`, `prompt_token_ids`, `policy_versions`, which plain OpenAI clients can ignore)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from app.common.containers import VersionSpan
from app.common.dialect_models import (
    DialectModel,
    NullsKept,
)
from app.dialects.openai.protocol import FunctionCall, ToolCall


class TopLogprob(DialectModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(DialectModel):
    content: list[TokenLogprob] | None = None


_REASONING = (
    "The reply's reasoning (inside <think>...</think>) when the server runs a reasoning parser "
    "(--reasoning-parser): vLLM's name for it; reasoning_content, SGLang's, carries the same."
)


class AssistantMessage(NullsKept):
    kept_null = ("content", "reasoning", "refusal")

    role: Literal["assistant"] = "assistant"
    content: str | None = Field(default=None, description="null: no text (tool calls alone).")
    refusal: str | None = Field(default=None, description="Always null (OpenAI's field).")
    reasoning: str | None = Field(default=None, description=_REASONING)
    reasoning_content: str | None = Field(default=None, description="Equal to reasoning.")
    tool_calls: list[ToolCall] | None = None


class ChoiceExtensions(NullsKept):
    """What vLLM adds to a choice; its keys are sent as null when unset, as vLLM sends them."""

    kept_null: ClassVar[tuple[str, ...]] = ("stop_reason", "token_ids", "routed_experts")

    token_ids: list[int] | None = Field(default=None, description="Extension (return_token_ids).")
    policy_versions: list[VersionSpan] | None = Field(
        default=None, description="Extension (return_token_ids): which weights sampled which."
    )
    routed_experts: str | None = Field(
        default=None,
        description="Extension (vLLM's), with --enable-return-routed-experts on a "
        "mixture-of-experts policy: base64 of a .npy array [tokens, num_hidden_layers, "
        "num_experts_per_tok], every prompt and output token but the last (a stream's last "
        "chunk carries it).",
    )
    stop_reason: int | str | None = Field(
        default=None,
        description="Extension (vLLM's): the stop token id or stop string that ended the "
        "choice; null at the end-of-sequence token or the length limit.",
    )


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class ChatChoice(ChoiceExtensions):
    kept_null = (*ChoiceExtensions.kept_null, "logprobs")

    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class Usage(DialectModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ReplyExtensions(DialectModel):
    policy_version: int = Field(description="Extension: the policy version it started on.")
    prompt_token_ids: list[int] | None = Field(
        default=None, description="Extension (return_token_ids): the prompt as templated."
    )
    trajectory_id: str | None = None
    turn: int | None = Field(default=None, description="Extension: its turn in the trajectory.")


class ChatCompletion(ReplyExtensions, NullsKept):
    kept_null = ("prompt_token_ids", "system_fingerprint")

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = Field(default=None, description="Always null.")


class ToolCallDelta(DialectModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCall | None = None


class ChatDelta(DialectModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = Field(default=None, description=_REASONING)
    reasoning_content: str | None = Field(default=None, description="Equal to reasoning.")
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(ChoiceExtensions):
    kept_null = (*ChoiceExtensions.kept_null, "logprobs", "finish_reason")

    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(ReplyExtensions):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# -- completions ---------------------------------------------------------------------------


class CompletionLogprobs(DialectModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(
        description="null: an echoed prompt's first token (or a log-prob of -infinity)."
    )
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int]


class PromptLogprob(DialectModel):
    logprob: float | None = Field(description="null: -infinity.")
    rank: int = Field(description="1 + how many tokens were more likely.")
    decoded_token: str


class CompletionChoice(ChoiceExtensions):
    kept_null = (
        *ChoiceExtensions.kept_null,
        "logprobs",
        "finish_reason",
        "prompt_token_ids",
        "prompt_logprobs",
    )

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_token_ids: list[int] | None = Field(
        default=None, description="Extension (return_token_ids): this choice's prompt."
    )
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        default=None,
        description="Extension (prompt_logprobs): per prompt token, null for the first, then "
        "token id -> its log-prob: the token's own and the k most likely.",
    )


class Completion(ReplyExtensions, NullsKept):
    kept_null = ("system_fingerprint",)

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = Field(default=None, description="Always null.")
