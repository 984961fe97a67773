"""Wire models of the OpenAI-compatible routes' requests (`/v1/chat/completions`,
`/v1/completions`): OpenAI's shapes, plus rlserve's RL extensions, which are off by default and
which plain OpenAI clients never send (`return_token_ids`, `logprobs_mode`, `top_k`,
`repetition_penalty`, `ignore_eos`, `trajectory_id`). Their answers are
`app.dialects.openai.answers`'."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.common.dialect_models import (
    DialectModel,
    dialect_schema,
)
from app.common.messages import template_kwargs
from app.common.protocol import (
    NOT_CONTINUE_AND_OPEN,
    POSITIVE,
    STREAMED,
    TOKEN_ID_KEYS,
    Annotations,
    BadWords,
    LogitBias,
    NoValue,
    Penalty,
    Refusal,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenId,
    TopP,
    field_error,
    never_together,
    stop_list,
)
from app.common.sampling import SamplingAsk

Stop = Annotated[str, Field(min_length=1)]
TRAJECTORY_ID = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Records this completion as the next turn of the trajectory with this id "
        "(also as the X-Trajectory-ID header): GET /v1/trajectories/{id}.",
    ),
]


class StreamOptions(DialectModel):
    include_usage: bool = False


Bias = Annotated[float, Field(ge=-100, le=100)]


class SamplingFields(DialectModel):
    """What both routes share: OpenAI's sampling parameters and the RL extensions. Unknown
    fields are ignored and logged, as vLLM's OpenAI server does (clients add their own: ART's
    `nvext`); a known field with a value rlserve cannot honour is still refused by name."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(
        default="policy",
        description="A name from GET /v1/models: policy (the default, as vLLM's first model) "
        "or reference.",
    )
    n: int = Field(default=1, ge=1, le=128)
    max_tokens: int | None = Field(default=None, gt=0)
    temperature: Temperature = None
    top_p: TopP = 1.0
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    seed: Seed | None = Field(
        default=None,
        description="Seeds each choice's own random stream, as on /v1/generate: the same seed "
        "gives the same tokens on both routes.",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = Field(
        default=0.0, description="Minus this once a token was generated."
    )
    frequency_penalty: Penalty = Field(
        default=0.0, description="Minus this times how often a token was generated."
    )
    logit_bias: LogitBias | None = Field(
        default=None,
        description="Token id (a string) -> bias added to its logit.",
        json_schema_extra=TOKEN_ID_KEYS,
    )
    user: str | None = Field(default=None, description="Accepted and ignored.")
    # RL extensions (vLLM's names and meanings)
    top_k: Annotated[int | None, Field(default=None, ge=-1, le=1 << 30)] = Field(
        default=None, description="Extension: the k most likely tokens only; 0 or -1: all."
    )
    min_p: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Extension: drop tokens less likely than min_p times the most likely one.",
    )
    repetition_penalty: RepetitionPenalty = 1.0
    ignore_eos: bool = False
    min_tokens: int = Field(
        default=0, ge=0, description="Extension (vLLM's): no stop before this many tokens."
    )
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Extension (vLLM's): stop after any of these tokens."
    )
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        default=None, description="Extension (vLLM's): sample only these tokens."
    )
    bad_words: BadWords | None = Field(
        default=None, description="Extension (vLLM's): words never generated."
    )
    return_token_ids: bool = Field(
        default=False,
        description="Extension: prompt_token_ids (as templated) and each choice's token_ids "
        "(every sampled token, a stop string's too), and policy_versions per choice.",
    )
    return_tokens_as_token_ids: bool | None = Field(
        default=None,
        description="Extension (vLLM's): name tokens in log-probs as 'token_id:<id>' instead "
        "of their text; unset: the server's choice (RLSERVE_MODELS__RETURN_TOKENS_AS_TOKEN_IDS, "
        "vLLM's --return-tokens-as-token-ids; off by default).",
    )
    logprobs_mode: Literal["raw", "processed"] = Field(
        default="raw",
        description="Extension: log-probs of the raw model distribution (temperature 1, no "
        "filtering: what a trainer computes) or of the distribution sampled from.",
    )
    use_beam_search: bool = Field(
        default=False,
        description="Extension (vLLM's): only false; beam search is not offered.",
        json_schema_extra={"const": False},
    )
    routed_experts_prompt_start: int = Field(
        default=0,
        ge=0,
        description="Extension (vLLM's), with --enable-return-routed-experts: leave out the "
        "routing of the first this many prompt tokens.",
    )
    trajectory_id: TRAJECTORY_ID | None = None

    @model_validator(mode="after")
    def _sampling_rules(self) -> SamplingFields:
        if self.use_beam_search:
            raise field_error("use_beam_search", "beam search is not offered: sample with n")
        return self

    @property
    def stops(self) -> list[str]:
        return stop_list(self.stop)

    def sampling_ask(self, max_new_tokens: int) -> SamplingAsk:
        return SamplingAsk.taken(self, max_new_tokens=max_new_tokens, stop=self.stops)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# -- chat ----------------------------------------------------------------------------------


class TextPart(DialectModel):
    type: Literal["text"]
    text: str


class FunctionCall(DialectModel):
    name: str
    arguments: str = Field(description="JSON text of the arguments.")


class ToolCall(DialectModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(DialectModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        description="developer: OpenAI's name for system instructions; templates that know "
        "no developer role get it as system (never dropped)."
    )
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = Field(
        default=None,
        description="An assistant turn's reasoning, for templates that render it (Qwen3, "
        "DeepSeek-R1: inside <think>...</think>).",
    )
    reasoning: str | None = Field(
        default=None, description="vLLM's name for reasoning_content (either may be sent)."
    )
    refusal: Refusal = None
    annotations: Annotations = None
    audio: NoValue = None
    function_call: NoValue = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: text content; tool-call arguments as the
        text sent (InputPreparer.as_template_takes gives templates that want an object the
        object)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content or self.refusal or ""}
        reasoning = self.reasoning_content if self.reasoning is None else self.reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": call.function.arguments,
                    },
                }
                for call in self.tool_calls
            ]
        return out


class FunctionDefinition(DialectModel):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(DialectModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(DialectModel):
    name: str


class NamedToolChoice(DialectModel):
    type: Literal["function"]
    function: NamedFunction


class ResponseFormat(DialectModel):
    type: Literal["text"] = Field(description="Only text: no constrained decoding.")


class ChatCompletionRequest(SamplingFields):
    # top_logprobs > 0 needs logprobs: true, in the schema as in the validator.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=dialect_schema(
            {
                "if": {
                    "required": ["top_logprobs"],
                    "properties": {"top_logprobs": {"type": "integer", "exclusiveMinimum": 0}},
                },
                "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                "allOf": [
                    NOT_CONTINUE_AND_OPEN,
                    never_together(top_logprobs=POSITIVE, stream=STREAMED),
                ],
            }
        ),
    )

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(
        default=None, gt=0, description="Wins over max_tokens."
    )
    logprobs: bool = False
    top_logprobs: int | None = Field(
        default=None, ge=0, description="With logprobs; at most the server's max_top_logprobs."
    )
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto"] | NamedToolChoice | Literal["required"] | None = Field(
        default=None,
        description="none or auto: a named function and required (which need constrained "
        "decoding) are refused by name.",
        json_schema_extra={"enum": ["none", "auto", None]},
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        default=None,
        description="vLLM's: more variables for the chat template (Qwen3's enable_thinking).",
    )
    add_generation_prompt: bool = Field(
        default=True, description="vLLM's: end the prompt with the assistant's turn opening."
    )
    continue_final_message: bool = Field(
        default=False,
        description="vLLM's: leave the last (assistant) message open for the model to go on.",
    )
    include_reasoning: bool = Field(
        default=True,
        description="vLLM's: with a reasoning parser, false leaves the reasoning out of the "
        "reply (its tokens stay in token_ids and the trajectory).",
    )
    separate_reasoning: bool = Field(
        default=True,
        description="SGLang's: with a reasoning parser, false leaves the reasoning in content "
        "as the model wrote it.",
    )
    parallel_tool_calls: bool | None = Field(default=None, description="Accepted and ignored.")
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = Field(default=None, description="Accepted and ignored.")
    store: bool | None = Field(default=None, description="Accepted and ignored.")

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        if self.tool_choice is not None and not isinstance(self.tool_choice, str):
            raise field_error("tool_choice", "naming a function needs constrained decoding")
        if self.tool_choice == "required":
            raise field_error("tool_choice", "required needs constrained decoding: use auto")
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error(
                "continue_final_message", "needs add_generation_prompt: false (not both)"
            )
        return self

    def template_options(self) -> dict[str, Any] | None:
        """What the chat template gets beyond the messages and tools."""
        options = template_kwargs(self.chat_template_kwargs) or {}
        if self.continue_final_message:
            options["continue_final_message"] = True
        return options or None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    # What is not streamed, in the schema as in the validators.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=dialect_schema(
            {
                "allOf": [
                    never_together(echo={"const": True}, stream=STREAMED),
                    never_together(prompt_logprobs={"type": "integer"}, stream=STREAMED),
                    never_together(logprobs=POSITIVE, stream=STREAMED),
                ]
            }
        ),
    )

    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    logprobs: int | None = Field(
        default=None, ge=0, description="The k most likely tokens at each step (and the chosen)."
    )
    echo: bool = Field(
        default=False,
        description="vLLM's: each choice's text and log-probs begin with its prompt's (the "
        "first prompt token's log-prob is null); not with stream.",
    )
    # Only what the validator allows, in the schema too (its message is the friendlier).
    suffix: str | None = Field(
        default=None, description="Only unset.", json_schema_extra={"type": "null"}
    )
    best_of: int | None = Field(default=None, description="Only unset or equal to n.")
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        description="Extension (vLLM's): each choice's prompt_logprobs, for every prompt "
        "token after the first: its raw log-prob and rank, and the k most likely tokens "
        "(at most the server's max_top_logprobs).",
    )

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.echo and self.stream:
            raise field_error("echo", "is not streamed: ask without stream")
        if self.suffix is not None:
            raise field_error("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", "must equal n (no server-side ranking)")
        return self

    def prompts(self) -> tuple[list[str] | None, list[list[int]] | None]:
        """(texts, token lists): the one the request gave."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt], None
        if all(isinstance(p, str) for p in prompt):
            return [str(p) for p in prompt], None
        if all(isinstance(p, int) for p in prompt):
            return None, [[p for p in prompt if isinstance(p, int)]]
        return None, [list(p) for p in prompt if isinstance(p, list)]
