"""Wire models of SGLang's RL routes (sglang 0.5.23: `srt/managers/io_struct.py`,
`srt/entrypoints/http_server.py`), field for field where rlserve honours them; a field rlserve
cannot honour is refused by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from app.common.dialect_models import (
    DialectModel,
    dialect_schema,
)
from app.common.protocol import (
    ONLY_UNSET,
    POSITIVE,
    TOKEN_ID_KEYS,
    AdapterName,
    RepetitionPenalty,
    Seed,
    ServerPath,
    TokenId,
    VersionText,
    field_error,
    never_together,
    one_of,
    stop_list,
)
from app.common.sampling import SamplingAsk
from app.engine.types import MAX_VERSION
from app.weights.transport import Transport

TokenIds = list[TokenId]


SAMPLING_REFUSED = (
    "stop_regex",
    "beam_width",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "watermark",
)
"""SGLang's sampling fields that would change what a trainer gets if ignored: refused by name
when given."""


class SamplingParams(DialectModel):
    """SGLang 0.5.23's sampling_params, every API field: honoured; accepted and ignored
    where it changes nothing returned (custom_params, stream_interval); or refused by name
    (`SAMPLING_REFUSED`: constrained decoding, beam search, stop regexes, watermarks)."""

    max_new_tokens: int = Field(default=128, gt=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(
        default=None, description="Generation stops after any of these (matched: the id)."
    )
    temperature: float = Field(default=1.0, ge=0, le=1e4)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=1 << 30, ge=-1, le=1 << 30, description="-1: all tokens.")
    min_p: float = Field(default=0.0, ge=0, le=1)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: RepetitionPenalty = 1.0
    min_new_tokens: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1, le=128)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: Seed | None = Field(
        default=None, description="Seeds each sample's own random stream, as /v1/generate's seed."
    )
    logit_bias: dict[str, float] | None = Field(
        default=None,
        description="Token id (a string) -> bias added to its logit.",
        json_schema_extra=TOKEN_ID_KEYS,
    )
    custom_params: Any = Field(default=None, description="Accepted and ignored.")
    stream_interval: int | None = Field(default=None, description="Accepted and ignored.")
    stop_regex: Any = Field(default=None, description="Only unset.", json_schema_extra=ONLY_UNSET)
    beam_width: int | None = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    json_schema: Any = Field(default=None, description="Only unset.", json_schema_extra=ONLY_UNSET)
    regex: Any = Field(default=None, description="Only unset.", json_schema_extra=ONLY_UNSET)
    ebnf: Any = Field(default=None, description="Only unset.", json_schema_extra=ONLY_UNSET)
    structural_tag: Any = Field(
        default=None, description="Only unset.", json_schema_extra=ONLY_UNSET
    )
    watermark: Any = Field(default=None, description="Only unset.", json_schema_extra=ONLY_UNSET)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        """SGLang reads null as the default for every field that has one."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @model_validator(mode="after")
    def _supported(self) -> SamplingParams:
        for name in SAMPLING_REFUSED:
            if getattr(self, name) is not None:
                raise field_error(
                    f"sampling_params.{name}", "is not supported here; leave it unset"
                )
        return self

    @property
    def stops(self) -> list[str]:
        return stop_list(self.stop)

    def sampling_ask(self, *, return_prompt_log_probs: bool, routed: bool) -> SamplingAsk:
        return SamplingAsk.taken(
            self,
            stop=self.stops,
            min_tokens=self.min_new_tokens,
            return_prompt_log_probs=return_prompt_log_probs,
            return_routed_experts=routed,
        )

    def ignored(self) -> list[str]:
        return [name for name in ("custom_params", "stream_interval") if getattr(self, name)]


def _generate_schema(schema: dict[str, Any]) -> None:
    """Exactly one of text and input_ids; top log-probs for output tokens only."""
    one_of(("text",), ("input_ids",))(schema)
    schema.update(
        never_together(
            top_logprobs_num=POSITIVE, logprob_start_len={"type": "integer", "minimum": 0}
        )
    )


class GenerateRequest(DialectModel):
    model_config = ConfigDict(json_schema_extra=dialect_schema(_generate_schema))

    text: str | Annotated[list[str], Field(min_length=1)] | None = None
    input_ids: TokenIds | Annotated[list[TokenIds], Field(min_length=1)] | None = None
    sampling_params: SamplingParams | Annotated[list[SamplingParams], Field(min_length=1)] = Field(
        default_factory=SamplingParams
    )
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(
        default=-1, ge=-1, description="-1: no prompt log-probs; k: from prompt position k."
    )
    top_logprobs_num: int = Field(default=0, ge=0)
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    stream: Literal[False] = Field(default=False, description="Only false.")
    image_data: list[Any] | None = Field(
        default=None, description="Only empty.", json_schema_extra={"maxItems": 0}
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Mixture-of-experts models (transformers backend): meta_info."
        "routed_experts, the experts each layer routed every fed token to, as SGLang gives "
        "them (base64 of int32 [tokens, num_hidden_layers, num_experts_per_tok], prompt and "
        "output tokens but the last).",
    )
    routed_experts_start_len: int = Field(
        default=0, ge=0, description="Leave out the routing of the first this many prompt tokens."
    )
    return_hidden_states: Literal[False] = Field(default=False, description="Only false.")
    lora_path: str | list[str | None] | None = Field(
        default=None,
        description="The LoRA adapter to generate with, by the name it was loaded under "
        "(`/load_lora_adapter`), or one per prompt (null: the policy itself).",
    )

    @model_validator(mode="after")
    def _inputs(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise field_error("input_ids", "give exactly one of text and input_ids")
        if self.image_data:
            raise field_error("image_data", "multimodal inputs are not supported")
        if self.top_logprobs_num and self.logprob_start_len >= 0:
            raise field_error("top_logprobs_num", "top log-probs are given for output tokens only")
        if isinstance(self.sampling_params, list) and len(self.sampling_params) != len(
            self.prompts()[0] or self.prompts()[1] or []
        ):
            raise field_error("sampling_params", "one entry per input, or a single one")
        return self

    @property
    def single(self) -> bool:
        return isinstance(self.text, str) or (
            self.input_ids is not None and all(isinstance(t, int) for t in self.input_ids)
        )

    def prompts(self) -> tuple[list[str] | None, list[list[int]] | None]:
        if self.text is not None:
            return ([self.text] if isinstance(self.text, str) else list(self.text)), None
        ids = self.input_ids or []
        if all(isinstance(t, int) for t in ids):
            return None, [[t for t in ids if isinstance(t, int)]]
        return None, [list(t) for t in ids if isinstance(t, list)]


class MetaInfo(DialectModel):
    id: str
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    weight_version: str
    weight_versions: list[dict[str, Any]] | None = None
    e2e_latency: float
    output_token_logprobs: list[list[Any]] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    output_token_logprobs_length: int | None = None
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    routed_experts: str | None = None


class GenerateOutput(DialectModel):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    prompt_token_ids: list[int] | None = None


class Success(DialectModel):
    success: bool = True
    message: str


class StatusMessage(DialectModel):
    message: str
    status: str = "ok"


class WeightVersion(DialectModel):
    weight_version: str


class Load(DialectModel):
    dp_rank: int = 0
    num_running_reqs: int = Field(description="Generations in flight.")
    num_waiting_reqs: int = Field(description="Requests waiting (for a pause to end, a slot).")
    num_total_reqs: int


class Loads(DialectModel):
    """SGLang's /v1/loads, with the counts slime's abort loop reads (one data-parallel rank)."""

    loads: list[Load]


class WorkerInfo(DialectModel):
    """One worker as SGLang's router lists it (sgl-model-gateway's `WorkerInfo`)."""

    id: str = Field(description="The worker's id (a UUID).")
    url: str = Field(description="Where the worker answers (this server).")
    model_id: str
    priority: int = 50
    cost: float = 1.0
    worker_type: Literal["regular"] = "regular"
    is_healthy: bool
    load: int = Field(description="Requests in flight and waiting.")
    connection_mode: Literal["Http"] = "Http"


class WorkerStats(DialectModel):
    prefill_count: int = 0
    decode_count: int = 0
    regular_count: int = 0


class Workers(DialectModel):
    workers: list[WorkerInfo]
    total: int
    stats: WorkerStats


class WorkerUrls(DialectModel):
    urls: list[str]


class RegisterWorker(DialectModel):
    """What a trainer posts to register an engine with the router (slime: `url`,
    `worker_type`, and a prefill worker's `bootstrap_port`)."""

    model_config = ConfigDict(extra="allow")

    url: str = Field(min_length=1, max_length=2048)
    worker_type: Literal["regular"] = Field(
        default="regular", description="Only regular: rlserve does not disaggregate."
    )


class WorkerRegistered(DialectModel):
    success: bool = True
    status: Literal["accepted"] = "accepted"
    worker_id: str
    url: str
    location: str
    message: str


class ModelInfo(DialectModel):
    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool = True
    weight_version: str
    preferred_sampling_params: None = None


class PauseGeneration(DialectModel):
    mode: Literal["abort", "retract", "in_place"] = Field(
        default="abort",
        description="abort: in-flight generations end now (finish_reason abort); retract and "
        "in_place: they are held and continue after /continue_generation, under the new "
        "weights (rlserve's keep).",
    )


class ContinueGeneration(DialectModel):
    torch_empty_cache: bool = Field(default=True, description="Accepted and ignored.")


class AbortRequest(DialectModel):
    rid: str = Field(
        default="",
        description="Only empty: abort by id is not supported.",
        json_schema_extra={"maxLength": 0},
    )
    abort_all: bool = False

    @model_validator(mode="after")
    def _all(self) -> AbortRequest:
        if self.rid:
            raise field_error("rid", "aborting one request is not supported; use abort_all")
        return self


class InitWeightsUpdateGroup(DialectModel):
    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=4096)
    group_name: str = Field(default="weight_update_group", min_length=1, max_length=256)
    backend: Transport = "nccl"
    timeout_s: float = Field(
        default=300.0, gt=0, le=3600, description="rlserve's: how long to wait for the trainer."
    )


class GroupName(DialectModel):
    group_name: str = Field(default="weight_update_group", max_length=256)


class BeginWeightUpdate(DialectModel):
    selector: Literal["target", "all"] = "all"


class UpdateWeightsFromDistributed(DialectModel):
    names: list[str] = Field(min_length=1, max_length=1 << 20)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default="weight_update_group", max_length=256)
    flush_cache: bool = Field(default=True, description="Accepted: updates leave no stale cache.")
    abort_all_requests: bool = Field(
        default=False, description="End in-flight generations before the update."
    )
    weight_version: VersionText | None = Field(
        default=None,
        description="A whole number (default: the next version); one not above the served "
        "version is a restarted trainer's count: served as the next version, in a new lineage.",
    )
    load_format: Literal["flattened_bucket"] | None = Field(
        default=None,
        description="null: one broadcast per tensor; flattened_bucket: one uint8 broadcast of "
        "all their bytes back to back.",
    )
    selector: Literal["target", "all"] = "all"
    torch_empty_cache: bool = Field(default=False, description="Accepted and ignored.")


class UpdateWeightsFromDisk(DialectModel):
    model_path: ServerPath
    load_format: str | None = Field(
        default=None,
        description="Only unset, auto or safetensors.",
        json_schema_extra={"enum": [None, "auto", "safetensors"]},
    )
    abort_all_requests: bool = False
    weight_version: VersionText | None = None
    flush_cache: bool = True
    torch_empty_cache: bool = False
    keep_pause: bool = False

    @model_validator(mode="after")
    def _format(self) -> UpdateWeightsFromDisk:
        if self.load_format not in (None, "auto", "safetensors"):
            raise field_error("load_format", "only safetensors checkpoints are loaded")
        return self


class DiskUpdated(Success):
    num_paused_requests: int = 0


class PullWeights(DialectModel):
    """slime's SGLang patch's /pull_weights body (`PullWeightsReqInput`)."""

    local_checkpoint_dir: ServerPath = Field(
        description="The host-local checkpoint the pulled version lands in (the server "
        "writes it; seeded from the model's own checkpoint, or a full published version)."
    )
    source_dir: ServerPath = Field(
        description="Where the trainer publishes its versions, weight_v{N:06d}: each a full "
        "checkpoint or a delta of the one before."
    )
    target_version: int = Field(ge=0, le=MAX_VERSION)


class LoadLoRAAdapter(DialectModel):
    """SGLang's /load_lora_adapter body."""

    lora_name: AdapterName
    lora_path: ServerPath = Field(description="A PEFT adapter folder the server can read.")
    pinned: bool = Field(default=False, description="No effect: every adapter stays resident.")
    lora_id: str | None = Field(default=None, description="No effect: names identify adapters.")


class UnloadLoRAAdapter(DialectModel):
    lora_name: AdapterName
    lora_id: str | None = Field(default=None, description="No effect: names identify adapters.")


class LoRAUpdated(DialectModel):
    """SGLang's answer to an adapter load or unload: the adapters served afterwards."""

    success: bool = True
    error_message: str | None = None
    loaded_adapters: dict[str, str] = Field(description="Each served adapter's folder, by name.")
