"""Wire models of vLLM's weight-transfer routes (vLLM 0.32:
`vllm/entrypoints/rl/online/api_router.py` and `vllm/distributed/weight_transfer/`): joining
the trainer's group, announcing tensors, the collective RPC form, finishing with a version;
field for field where rlserve honours them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, RootModel, Tag, model_validator

from app.common.dialect_models import (
    DialectModel,
    dialect_schema,
)
from app.common.protocol import (
    ONLY_UNSET,
    ServerPath,
    VersionText,
    field_error,
    one_of,
)
from app.engine.types import MAX_VERSION
from app.updates.types import Announcement

DEFAULT_PACKED_BUFFER_BYTES = 1 << 30
"""vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES."""


class InitInfo(DialectModel):
    """vLLM's NCCLWeightTransferInitInfo (what its trainer engine and TRL send)."""

    master_address: str = Field(min_length=1, max_length=253)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1)
    world_size: int = Field(ge=2, le=4096)
    packed: bool = False
    packed_buffer_size_bytes: int = Field(
        default=DEFAULT_PACKED_BUFFER_BYTES, ge=1 << 16, le=16 << 30
    )
    packed_num_buffers: int = Field(
        default=2, ge=1, le=64, description="Accepted: buffers in flight change no byte."
    )
    nccl_unique_id_b64: str | None = Field(
        default=None,
        description="Not supported: rendezvous at master_address/master_port.",
        json_schema_extra=ONLY_UNSET,
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


class InitBroadcaster(DialectModel):
    """prime-rl's NCCL weight broadcast, as its orchestrator joins each server to it
    (`init_nccl_broadcast`, src/prime_rl/utils/client.py at 559b4477): the trainer is rank 0
    and hosts the rendezvous at host:port; the server's ranks follow rank_offset."""

    host: str = Field(min_length=1, max_length=253)
    port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=0, ge=0, description="The server's first rank, less one.")
    inference_world_size: int = Field(
        ge=1, le=4095, description="Every server's ranks together (the trainer is one more)."
    )
    timeout: float = Field(
        default=1200, gt=0, le=86400, description="Seconds the join and each receive may take."
    )
    quantize_in_weight_transfer: bool = Field(
        default=False,
        description="Only false: the weights come in the checkpoint's names and dtypes.",
        json_schema_extra={"const": False},
    )
    session_id: str = Field(default="default", max_length=256, description="Accepted (NIXL's).")

    @model_validator(mode="after")
    def _unquantized(self) -> InitBroadcaster:
        if self.quantize_in_weight_transfer:
            raise field_error(
                "quantize_in_weight_transfer",
                "is not supported: rlserve takes the checkpoint's tensors, as sent unquantized",
            )
        return self


class DeltaInitInfo(DialectModel):
    """SkyRL 0.4.0's checkpoint-delta backend (`DeltaTrainerInitInfo`, as its trainer sends it
    once): the trainer publishes deltas to a folder; the server pulls them (POST
    /fetch_weights) into a local checkpoint of its own, seeded from the model it started
    with, and loads it (POST /update_weights)."""

    base_model_path: str = Field(
        max_length=4096,
        description="Accepted: the server's base is the model it started with (each delta's "
        "checksums refuse another).",
    )
    local_checkpoint_dir: str = Field(
        max_length=4096, description="Accepted: the server keeps its local checkpoint itself."
    )
    cloud_download_workers: int = Field(default=4, ge=1, description="Accepted.")
    checkpoint_load_format: str = Field(default="vllm_multi_thread_safetensors", max_length=64)
    multi_thread_safetensors_max_workers: int = Field(default=8, ge=1, description="Accepted.")


def _init_kind(value: Any) -> str:
    return "delta" if isinstance(value, dict) and "local_checkpoint_dir" in value else "nccl"


class InitWeightTransfer(DialectModel):
    init_info: Annotated[
        Annotated[InitInfo, Tag("nccl")] | Annotated[DeltaInitInfo, Tag("delta")],
        Discriminator(_init_kind),
    ]


class DeltaUpdateInfo(DialectModel):
    """SkyRL's checkpoint-delta update (`DeltaPublishResult` as published): the version its
    publisher wrote under `sync_dir`, loaded once pulled."""

    target_version: int = Field(ge=1, le=MAX_VERSION)
    version: int | None = Field(default=None, ge=1, le=MAX_VERSION)
    sync_dir: ServerPath
    uri: str | None = Field(default=None, max_length=4096)


class FetchedVersion(DialectModel):
    status: Literal["ok"] = "ok"
    target_version: int


class Fetched(DialectModel):
    """SkyRL's /fetch_weights answer: one result per worker (here, one)."""

    status: Literal["ok"] = "ok"
    result: list[FetchedVersion]


LocalUri = Annotated[
    str, Field(max_length=4096, json_schema_extra={"not": {"pattern": "^(gs|s3)://"}})
]


class FetchWeights(DialectModel):
    """SkyRL's POST /fetch_weights: pull `target_version` (its `delta-{N:08d}` folders under
    `sync_dir`) into the server's local checkpoint, before the pause."""

    target_version: int = Field(ge=0, le=MAX_VERSION)
    sync_dir: ServerPath = Field(description="The folder SkyRL publishes its versions under.")
    uri: LocalUri | None = Field(
        default=None,
        description="The target version's folder, under sync_dir (gs:// and s3:// are not "
        "fetched: publish to a folder the server reads).",
    )

    @model_validator(mode="after")
    def _local(self) -> FetchWeights:
        if self.uri is not None and self.uri.startswith(("gs://", "s3://")):
            raise field_error("uri", "object-store URIs are not fetched: publish to a folder")
        return self


class StartWeightUpdate(DialectModel):
    is_checkpoint_format: bool = Field(
        default=True,
        description="Only true: tensors named and shaped as in the checkpoint.",
        json_schema_extra={"const": True},
    )

    @model_validator(mode="after")
    def _checkpoint(self) -> StartWeightUpdate:
        if not self.is_checkpoint_format:
            raise field_error("is_checkpoint_format", "only checkpoint-format tensors are loaded")
        return self


class UpdateInfo(DialectModel):
    """vLLM's NCCLWeightTransferUpdateInfo: the tensors of the next broadcasts. Releases
    before 0.32 (SkyRL 0.3.0's and 0.4.0's) name the packing here, per update; 0.32 names it
    once, in the init info."""

    names: list[str] = Field(min_length=1, max_length=1 << 20)
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool | None = Field(
        default=None,
        description="vLLM before 0.32: the tensors come packed into buckets (unset: as the "
        "init info said).",
    )
    packed_buffer_size_bytes: int | None = Field(
        default=None,
        ge=1 << 16,
        le=16 << 30,
        description="vLLM before 0.32: the packed buckets' size (unset with packed: vLLM's "
        "default, 1 GiB; unset without: the init info's).",
    )
    packed_num_buffers: int | None = Field(
        default=None, ge=1, le=64, description="Accepted: buffers in flight change no byte."
    )

    def announcement(self) -> Announcement:
        """The policy's tensors this announces, cut as it says."""
        size = self.packed_buffer_size_bytes
        if self.packed is not None and size is None:
            size = DEFAULT_PACKED_BUFFER_BYTES
        return Announcement(
            "policy",
            self.names,
            self.dtype_names,
            self.shapes,
            packing=None if self.packed is None else "vllm" if self.packed else "announced",
            bucket_bytes=size,
        )


def _update_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    return "delta" if isinstance(value, dict) and "target_version" in value else "nccl"


class UpdateWeights(DialectModel):
    """vLLM's announcement of the tensors the trainer broadcasts next (`update_info`), or the
    folder of a checkpoint to load (`weight_dir`: prime-rl's vLLM sends it)."""

    model_config = ConfigDict(
        json_schema_extra=dialect_schema(one_of(("update_info",), ("weight_dir",)))
    )

    update_info: (
        Annotated[
            Annotated[UpdateInfo, Tag("nccl")]
            | Annotated[list[UpdateInfo], Field(min_length=1, max_length=1024), Tag("list")]
            | Annotated[DeltaUpdateInfo, Tag("delta")],
            Discriminator(_update_kind),
        ]
        | None
    ) = None
    weight_dir: ServerPath | None = Field(
        default=None, description="A safetensors checkpoint the server can read."
    )

    @model_validator(mode="after")
    def _one(self) -> UpdateWeights:
        if (self.update_info is None) == (self.weight_dir is None):
            raise field_error("update_info", "give exactly one of update_info and weight_dir")
        return self

    @property
    def infos(self) -> list[UpdateInfo]:
        if self.update_info is None or isinstance(self.update_info, DeltaUpdateInfo):
            return []
        return self.update_info if isinstance(self.update_info, list) else [self.update_info]

    @property
    def delta(self) -> DeltaUpdateInfo | None:
        return self.update_info if isinstance(self.update_info, DeltaUpdateInfo) else None


class RpcCall(DialectModel):
    """`/collective_rpc`'s body: a worker method's name, its arguments, a timeout."""

    args: list[Any] = Field(
        default_factory=list, description="Only empty: the methods take keywords.", max_length=0
    )
    timeout: float | None = Field(default=None, gt=0, description="Accepted and ignored.")


class StartKwargs(DialectModel):
    is_checkpoint_format: bool = Field(
        default=True,
        description="Only true: tensors named and shaped as in the checkpoint.",
        json_schema_extra={"const": True},
    )

    @model_validator(mode="after")
    def _checkpoint(self) -> StartKwargs:
        if not self.is_checkpoint_format:
            raise field_error(
                "kwargs.is_checkpoint_format", "only checkpoint-format tensors are loaded"
            )
        return self


class StartRpc(RpcCall):
    """SkyRL's worker extension's `skyrl_start_weight_update`: POST /start_weight_update."""

    method: Literal["skyrl_start_weight_update"]
    kwargs: StartKwargs = Field(default_factory=StartKwargs)


class UpdateKwargs(DialectModel):
    update_info: UpdateInfo


class UpdateRpc(RpcCall):
    """SkyRL's `update_weights_nccl`: POST /update_weights (the tensors of the trainer's
    broadcast, packed as `update_info` says)."""

    method: Literal["update_weights_nccl"]
    kwargs: UpdateKwargs


class NoKwargs(DialectModel):
    pass


class FinishRpc(RpcCall):
    """SkyRL's `skyrl_finish_weight_update`: POST /finish_weight_update (the next version)."""

    method: Literal["skyrl_finish_weight_update"]
    kwargs: NoKwargs = Field(default_factory=NoKwargs)


class CollectiveRpc(
    RootModel[Annotated[StartRpc | UpdateRpc | FinishRpc, Field(discriminator="method")]]
):
    """The worker methods of SkyRL's vLLM extension (`NewInferenceWorkerWrap`, SkyRL 0.3.0)
    its trainer calls through vLLM's `/collective_rpc`, over the same weight controls as vLLM's
    own routes. Others (CUDA IPC's `update_weights_ipc`, sleep and wake) are refused by name."""


class RpcResults(DialectModel):
    results: list[Any] = Field(description="Each worker's return value (null: none).")


class FinishWeightUpdate(DialectModel):
    weight_version: VersionText | None = Field(
        default=None,
        description="A whole number (default: the next version); one not above the served "
        "version is a restarted trainer's count: served as the next version, in a new lineage.",
    )


class NewVersion(DialectModel):
    new_version: str
    abort_all_requests: bool = Field(default=False, description="Accepted (SGLang's); ignored.")


class VersionConfirmed(DialectModel):
    success: bool = True
    new_version: str
    message: str


class WeightInfo(DialectModel):
    weight_version: str


# -- /inference/v1/generate ------------------------------------------------------------------
