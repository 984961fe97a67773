"""Wire models of vLLM's RL routes (vLLM 0.32: `vllm/entrypoints/rl/online/api_router.py`,
`vllm/distributed/weight_transfer/`, and `/inference/v1/generate`), field for field where
rlserve honours them; a field rlserve cannot honour is refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from app.common.protocol import RepetitionPenalty, Seed, WireModel, field_error, stop_list
from app.engine.types import VersionSpan as EngineSpan


class Message(WireModel):
    message: str


class Status(WireModel):
    status: str


class IsPaused(WireModel):
    is_paused: bool


class WorldSize(WireModel):
    world_size: int = Field(description="The server's ranks in a weight-transfer group.")


class PrefixCacheReset(WireModel):
    success: bool


class Aborted(WireModel):
    status: Literal["aborted"] = "aborted"
    aborted: int


class AbortRequests(WireModel):
    request_ids: list[str] | None = Field(
        default=None, description="Only empty or absent: every in-flight generation."
    )

    @model_validator(mode="after")
    def _all(self) -> AbortRequests:
        if self.request_ids:
            raise field_error(
                "request_ids", "aborting chosen requests is not supported; send none for all"
            )
        return self


class InitInfo(WireModel):
    """vLLM's NCCLWeightTransferInitInfo (what its trainer engine and TRL send)."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1)
    world_size: int = Field(ge=2, le=4096)
    packed: bool = False
    packed_buffer_size_bytes: int = Field(default=1 << 30, ge=1 << 16, le=16 << 30)
    packed_num_buffers: int = Field(
        default=2, ge=1, le=64, description="Accepted: buffers in flight change no byte."
    )
    nccl_unique_id_b64: str | None = Field(
        default=None, description="Not supported: rendezvous at master_address/master_port."
    )
    timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="rlserve's: how long to wait for the trainer."
    )

    @model_validator(mode="after")
    def _rendezvous(self) -> InitInfo:
        if self.nccl_unique_id_b64 is not None:
            raise field_error(
                "init_info.nccl_unique_id_b64",
                "is not supported: give master_address and master_port (a TCPStore)",
            )
        return self


class InitWeightTransfer(WireModel):
    init_info: InitInfo


class StartWeightUpdate(WireModel):
    is_checkpoint_format: bool = Field(
        default=True, description="Only true: tensors named and shaped as in the checkpoint."
    )

    @model_validator(mode="after")
    def _checkpoint(self) -> StartWeightUpdate:
        if not self.is_checkpoint_format:
            raise field_error("is_checkpoint_format", "only checkpoint-format tensors are loaded")
        return self


class UpdateInfo(WireModel):
    names: list[str] = Field(min_length=1, max_length=1 << 20)
    dtype_names: list[str]
    shapes: list[list[int]]


class UpdateWeights(WireModel):
    update_info: UpdateInfo | Annotated[list[UpdateInfo], Field(min_length=1, max_length=1024)]

    @property
    def infos(self) -> list[UpdateInfo]:
        return self.update_info if isinstance(self.update_info, list) else [self.update_info]


class FinishWeightUpdate(WireModel):
    weight_version: str | None = Field(
        default=None, description="A whole number above the current version (default: next)."
    )


class NewVersion(WireModel):
    new_version: str
    abort_all_requests: bool = Field(default=False, description="Accepted (SGLang's); ignored.")


class VersionConfirmed(WireModel):
    success: bool = True
    new_version: str
    message: str


class WeightInfo(WireModel):
    weight_version: str


# -- /inference/v1/generate ------------------------------------------------------------------


class SamplingParams(WireModel):
    """vLLM's SamplingParams, the fields rlserve honours (the rest refused by name)."""

    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0, le=1e4)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1, le=1 << 30, description="0 or -1: all tokens.")
    min_p: float = Field(default=0.0, ge=0, le=1)
    seed: Seed | None = None
    max_tokens: int | None = Field(default=16, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(
        default=None, description="Only empty: stop at end-of-sequence or at `stop` strings."
    )
    ignore_eos: bool = False
    logprobs: int | None = Field(default=None, ge=0, description="The k most likely per token.")
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: float = Field(default=0.0, ge=0, le=0, description="Only 0.")
    frequency_penalty: float = Field(default=0.0, ge=0, le=0, description="Only 0.")
    min_tokens: int = Field(default=0, ge=0, le=0, description="Only 0.")
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: int = Field(default=2, description="Only 2 (final output).")

    @model_validator(mode="after")
    def _supported(self) -> SamplingParams:
        if self.stop_token_ids:
            raise field_error("sampling_params.stop_token_ids", "is not supported; use stop")
        if self.output_kind != 2:
            raise field_error("sampling_params.output_kind", "only 2 (the final output)")
        return self

    @property
    def stops(self) -> list[str]:
        return stop_list(self.stop)


class InferenceGenerateRequest(WireModel):
    request_id: str | None = Field(default=None, max_length=256)
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(min_length=1)
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    features: Any | None = Field(default=None, description="Only null: no multimodal input.")
    return_token_ids: bool | None = None
    output_mode: Literal["tokens"] = "tokens"
    stream: Literal[False] = False
    priority: int = 0
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> InferenceGenerateRequest:
        if self.features is not None:
            raise field_error("features", "multimodal inputs are not supported")
        if self.model not in (None, "policy"):
            raise field_error("model", "only the policy generates here")
        return self


class GenerateLogProb(WireModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = Field(default_factory=list)


class GenerateLogProbs(WireModel):
    content: list[GenerateLogProbsContent] | None = None


class WeightVersionSpan(WireModel):
    version: str
    start: int
    end: int

    @classmethod
    def of(cls, span: EngineSpan) -> WeightVersionSpan:
        return cls(version=str(span.version), start=span.start, end=span.end)


class GenerateChoice(WireModel):
    index: int
    finish_reason: Literal["stop", "length", "abort"]
    stop_reason: int | str | None = None
    token_ids: list[int]
    logprobs: GenerateLogProbs | None = None
    weight_versions: list[WeightVersionSpan] | None = None


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class InferenceGenerateResponse(WireModel):
    request_id: str
    model: str
    created: int
    output_mode: Literal["tokens"] = "tokens"
    choices: list[GenerateChoice]
    prompt_token_ids: list[int] | None = None
    usage: Usage
