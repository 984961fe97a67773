"""Wire models of vLLM's RL routes (vLLM 0.32: `vllm/entrypoints/rl/online/api_router.py` and
`/inference/v1/generate`) but its weight transfer's (`app.dialects.vllm.transfer`), field for
field where rlserve honours them; a field rlserve cannot honour is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.common.constraints import MAX_BAD_WORDS
from app.common.dialect_models import (
    DialectModel,
    dialect_schema,
)
from app.common.protocol import (
    ONLY_UNSET,
    TOKEN_ID_KEYS,
    AdapterName,
    RepetitionPenalty,
    Seed,
    ServerPath,
    TokenId,
    field_error,
    never_together,
    stop_list,
)
from app.common.sampling import SamplingAsk
from app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.engine.types import VersionSpan as EngineSpan


class Message(DialectModel):
    message: str


class Status(DialectModel):
    status: str


class IsPaused(DialectModel):
    is_paused: bool


class WorldSize(DialectModel):
    world_size: int = Field(description="The server's ranks in a weight-transfer group.")


class PrefixCacheReset(DialectModel):
    success: bool


class Aborted(DialectModel):
    status: Literal["aborted"] = "aborted"
    aborted: int


class AbortRequests(DialectModel):
    request_ids: list[str] | None = Field(
        default=None,
        description="Only empty or absent: every in-flight generation.",
        json_schema_extra={"maxItems": 0},
    )

    @model_validator(mode="after")
    def _all(self) -> AbortRequests:
        if self.request_ids:
            raise field_error(
                "request_ids", "aborting chosen requests is not supported; send none for all"
            )
        return self


IGNORED = {
    "flat_logprobs": False,
    "stream_interval": None,
    "skip_clone": False,
    "output_text_buffer_length": 0,
    "extra_args": None,
    "skip_reading_prefix_cache": None,
    "trace_decode_token_ids": None,
}
"""vLLM's sampling fields that change nothing rlserve returns, with their defaults: accepted,
and logged as ignored when given another value."""

REFUSED_WHY = {
    "best_of": "only unset or equal to n (vLLM's V1 engine has no best_of either)",
    "output_kind": "1 (deltas) would answer only the last delta unstreamed; use 0 or 2",
}


class SamplingParams(DialectModel):
    """vLLM 0.32's SamplingParams, every field: honoured, accepted and ignored where it
    changes nothing returned (`IGNORED`, logged), or refused by name where ignoring it would
    change what the trainer gets (structured outputs, watermarking, beam search, ...). Other
    keys are ignored (logged), as vLLM ignores them: trainers pass their own configs through
    (verifiers' `reasoning_effort`)."""

    model_config = ConfigDict(extra="allow")

    n: int = Field(default=1, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, description="Only unset or n.")
    use_beam_search: bool = Field(
        default=False, description="Only false.", json_schema_extra={"const": False}
    )
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: RepetitionPenalty = 1.0
    temperature: float = Field(default=1.0, ge=0, le=1e4)
    watermarking: Any | None = Field(
        default=None, description="Only unset or false.", json_schema_extra={"enum": [None, False]}
    )
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=1 << 30, description="0 or -1: all tokens.")
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Generation stops after any of these (stop_reason: the id)."
    )
    ignore_eos: bool = False
    max_tokens: int | None = Field(default=16, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    logprobs: int | None = Field(default=None, ge=0, description="The k most likely per token.")
    prompt_logprobs: int | None = Field(
        default=None,
        ge=0,
        description="Each prompt token's log-prob and rank, and the k most likely.",
    )
    prompt_logprob_token_ids: list[int] | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    prompt_logprob_start: int | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    logprob_token_ids: list[int] | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    truncate_prompt_tokens: int | None = Field(
        default=None, ge=-1, description="Keep the last k prompt tokens (-1: no limit)."
    )
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = Field(
        default=0,
        ge=0,
        le=2,
        description="0 (cumulative) or 2 (final): the same answer here.",
        json_schema_extra={"enum": [0, 2]},
    )
    structured_outputs: Any | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    guided_decoding: Any | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    logit_bias: dict[int, float] | None = Field(
        default=None,
        description="Token id -> bias added to its logit (before the penalties).",
        json_schema_extra=TOKEN_ID_KEYS,
    )
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, max_length=MAX_BAD_WORDS
    )
    thinking_token_budget: int | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    repetition_detection: Any | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    flat_logprobs: bool = Field(default=False, description="Accepted: the JSON is the same.")
    stream_interval: int | None = Field(default=None, description="Accepted and ignored.")
    skip_clone: bool = Field(default=False, description="Accepted and ignored.")
    output_text_buffer_length: int = Field(default=0, description="Accepted and ignored.")
    extra_args: dict[str, Any] | None = Field(default=None, description="Accepted and ignored.")
    skip_reading_prefix_cache: bool | None = Field(
        default=None, description="Accepted and ignored."
    )
    routed_experts_prompt_start: int = Field(
        default=0,
        ge=0,
        description="With --enable-return-routed-experts: leave out the routing of the first "
        "this many prompt tokens.",
    )
    trace_decode_token_ids: list[int] | None = Field(
        default=None, description="Accepted and ignored."
    )

    @model_validator(mode="after")
    def _supported(self) -> SamplingParams:
        refused = {
            "watermarking": self.watermarking not in (None, False),
            "use_beam_search": self.use_beam_search,
            "best_of": self.best_of not in (None, self.n),
            "prompt_logprob_token_ids": self.prompt_logprob_token_ids is not None,
            "prompt_logprob_start": self.prompt_logprob_start is not None,
            "logprob_token_ids": self.logprob_token_ids is not None,
            "structured_outputs": self.structured_outputs is not None,
            "guided_decoding": self.guided_decoding is not None,
            "thinking_token_budget": self.thinking_token_budget is not None,
            "repetition_detection": self.repetition_detection is not None,
            "output_kind": self.output_kind == 1,
        }
        for name, bad in refused.items():
            if bad:
                raise field_error(
                    f"sampling_params.{name}",
                    REFUSED_WHY.get(name, "is not supported here; leave it unset"),
                )
        return self

    @property
    def stops(self) -> list[str]:
        return stop_list(self.stop)

    def sampling_ask(self) -> SamplingAsk:
        return SamplingAsk.taken(self, max_new_tokens=self.max_tokens, stop=self.stops)

    def ignored(self) -> list[str]:
        """The given fields that change nothing here (logged)."""
        given = [name for name, default in IGNORED.items() if getattr(self, name) != default]
        return given + list(self.model_extra or {})


REQUEST_IGNORED = (
    "token_offsets",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "stream_options",
    "kv_transfer_params",
    "ec_transfer_params",
)


class InferenceGenerateRequest(DialectModel):
    """vLLM's GenerateRequest. Unknown top-level fields are ignored, as vLLM does (logged)."""

    # output_mode text needs detokenize, in the schema as in the validator.
    model_config = ConfigDict(
        extra="allow",
        json_schema_extra=dialect_schema(
            never_together(
                output_mode={"const": "text"},
                sampling_params={
                    "required": ["detokenize"],
                    "properties": {"detokenize": {"const": False}},
                },
            )
        ),
    )

    request_id: str | None = Field(default=None, max_length=256)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    features: Any | None = Field(
        default=None, description="Only null: no multimodal input.", json_schema_extra=ONLY_UNSET
    )
    content_parts: Any | None = Field(
        default=None, description="Only null: no multimodal input.", json_schema_extra=ONLY_UNSET
    )
    return_token_ids: bool | None = None
    output_mode: Literal["tokens", "text"] = Field(
        default="tokens",
        description="tokens: ids and their log-probs; text: also the text, with OpenAI-style "
        "log-probs carrying each token's text and bytes.",
    )
    stream: Literal[False] = False
    priority: int = 0
    cache_salt: str | None = None
    token_offsets: Any | None = Field(default=None, description="Accepted and ignored.")
    reasoning_ended: bool | None = Field(default=None, description="Accepted and ignored.")
    reasoning_parser_kwargs: Any | None = Field(default=None, description="Accepted and ignored.")
    stream_options: Any | None = Field(default=None, description="Accepted and ignored.")
    kv_transfer_params: Any | None = Field(default=None, description="Accepted and ignored.")
    ec_transfer_params: Any | None = Field(default=None, description="Accepted and ignored.")

    @model_validator(mode="after")
    def _text_only(self) -> InferenceGenerateRequest:
        if self.features is not None:
            raise field_error("features", "multimodal inputs are not supported")
        if self.content_parts is not None:
            raise field_error("content_parts", "multimodal inputs are not supported")
        if self.output_mode == "text" and not self.sampling_params.detokenize:
            raise field_error("output_mode", "'text' needs sampling_params.detokenize true")
        return self

    def ignored(self) -> list[str]:
        """What was given that changes nothing here (unknown fields too, as vLLM ignores
        them)."""
        given = [name for name in REQUEST_IGNORED if getattr(self, name) is not None]
        sampling = [f"sampling_params.{n}" for n in self.sampling_params.ignored()]
        return given + list(self.model_extra or {}) + sampling


class GenerateLogProb(DialectModel):
    """vLLM 0.32's entry (`token_id`, `logprob`, `rank`), with the `token` of the releases
    before it (`token_id:N`, what renderers and SkyRL's older clients check)."""

    token_id: int
    token: str
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(DialectModel):
    content: list[GenerateLogProbsContent] | None = None


class WeightVersionSpan(DialectModel):
    version: str
    start: int
    end: int

    @classmethod
    def of(cls, span: EngineSpan, label: Callable[[int], str] = str) -> WeightVersionSpan:
        """`span`, its version as `label` names it (the trainer's count)."""
        return cls(version=label(span.version), start=span.start, end=span.end)


class TextLogProb(DialectModel):
    """OpenAI's log-prob entry, as vLLM's `output_mode: text` answers it."""

    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class TextLogProbsContent(TextLogProb):
    top_logprobs: list[TextLogProb] = Field(default_factory=list)


class TextLogProbs(DialectModel):
    content: list[TextLogProbsContent] | None = None


class PromptLogProb(DialectModel):
    """vLLM's `Logprob`: one prompt position's entry for one token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class GenerateChoice(DialectModel):
    index: int
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: int | str | None = None
    text: str | None = Field(default=None, description="output_mode text only.")
    token_ids: list[int]
    logprobs: GenerateLogProbs | TextLogProbs | None = None
    weight_versions: list[WeightVersionSpan] | None = None
    routed_experts: str | None = Field(
        default=None,
        description="With --enable-return-routed-experts, on a mixture-of-experts policy: "
        "base64 of a .npy array [tokens, num_hidden_layers, num_experts_per_tok] (uint8, "
        "uint16 past 256 experts), every prompt and output token but the last, from "
        "routed_experts_prompt_start on.",
    )


class Usage(DialectModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class InferenceGenerateResponse(DialectModel):
    request_id: str
    model: str
    created: int
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]
    prompt_logprobs: list[dict[str, PromptLogProb] | None] | None = Field(
        default=None,
        description="With sampling_params.prompt_logprobs: null for the first token, then "
        "token id -> entry (the prompt's own token, then the k most likely).",
    )
    prompt_token_ids: list[int] | None = None
    usage: Usage


# -- /v1/chat/completions/render, /v1/completions/render and their derender -------------------


class RenderedRequest(InferenceGenerateRequest):
    """What the render routes answer: the `/inference/v1/generate` body that samples the
    rendered request (vLLM's GenerateRequest), `stream` as the request asked."""

    stream: bool = False  # type: ignore[assignment]


class TokensAnswer(InferenceGenerateResponse):
    """An `/inference/v1/generate` answer with `output_mode` tokens (a text answer is already
    detokenized: vLLM derenders only these too)."""

    output_mode: Literal["tokens"] = "tokens"


class DerenderChatRequest(DialectModel):
    """vLLM's DerenderChatRequest: a token-in, token-out answer to read back as a chat reply.
    The chat request that was rendered is required here: its tools, stops, reasoning and
    log-prob settings shape the reply."""

    stream: Literal[False] = Field(
        default=False, description="Only false: streamed derendering is not served."
    )
    model: str | None = None
    generate_response: TokensAnswer
    prompt_tokens: int | None = Field(default=None, ge=0, description="Accepted and ignored.")
    prompt_token_ids: list[int] | None = Field(default=None, description="Accepted and ignored.")
    chat_request: ChatCompletionRequest


class DerenderCompletionRequest(DialectModel):
    """vLLM's DerenderCompletionRequest: one token-in, token-out answer per rendered prompt,
    with the completion request that was rendered (required here, as for chat)."""

    stream: Literal[False] = Field(
        default=False, description="Only false: streamed derendering is not served."
    )
    model: str | None = None
    generate_responses: list[TokensAnswer] = Field(min_length=1)
    prompt_tokens: list[int] | None = Field(default=None, description="Accepted and ignored.")
    prompt_token_ids: list[list[int] | None] | None = Field(
        default=None, description="Accepted and ignored."
    )
    completion_request: CompletionRequest


class LoadLoRAAdapter(DialectModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: AdapterName
    lora_path: ServerPath = Field(description="A PEFT adapter folder the server can read.")
    load_inplace: bool = Field(
        default=False,
        description="Serve a loaded name's new tensors as its next version (refused when false).",
    )
    is_3d_lora_weight: Literal[False] = Field(
        default=False, description="Only false: MoE experts' 3-D LoRA weights are not served."
    )


class UnloadLoRAAdapter(DialectModel):
    lora_name: AdapterName
    lora_int_id: int | None = Field(default=None, description="No effect, as in vLLM.")
