"""Wire models of the weight routes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from app.common.failures import Failure
from app.common.protocol import AdapterName, ServerPath, Version, WireModel
from app.errors import failure_error
from app.updates.types import (
    BUCKET_BYTES,
    STREAMS,
    TIMEOUT_S,
    Announcement,
    Applied,
    Connection,
    Join,
    Packing,
    PauseMode,
    Publish,
    RendezvousStyle,
    ServedWeights,
    SnapshotAsk,
    TransferStatus,
    Transport,
    TransportChoice,
    Versions,
)

UpdatedModel = Literal["policy", "reference", "judge", "reward"]
"""A served model whose weights the weight routes change: the policy, the reference, the judge
model (--judge-model) or the reward model (--reward-model); one the server does not serve is
404."""

MODEL_DOC = "The model whose weights change (the reward and judge models' only when served)."

PAUSE_MODES_DOC = (
    "How in-flight work meets the pause: 'wait' lets it finish; 'abort' ends generations at "
    "their next token (they return what they produced, finish_reason 'abort'); 'keep' freezes "
    "generations and continues them afterwards. New requests wait in every mode; scoring "
    "always finishes first."
)


class WeightsVersion(WireModel):
    policy_version: int
    reference_version: int

    @classmethod
    def of(cls, versions: Versions) -> WeightsVersion:
        return cls(policy_version=versions.policy, reference_version=versions.reference)


class UpdateOptions(WireModel):
    version: Version | None = Field(
        default=None,
        description="The version this update publishes for `model`: above the current one "
        "(409 otherwise), at most 2^53 - 1. Default: the current one plus one.",
    )
    pause: PauseMode = Field(default="keep", description=PAUSE_MODES_DOC)

    def publish(self) -> Publish:
        return Publish(version=self.version, pause=self.pause)


class LoadWeightsRequest(UpdateOptions):
    path: ServerPath = Field(
        description="A safetensors checkpoint directory (HF layout) or file the server can read.",
    )
    model: UpdatedModel = Field(default="policy", description=MODEL_DOC)


SnapshotIdentity = Annotated[str, Field(min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")]
Digest = Annotated[str, Field(max_length=128, pattern=r"^[a-z0-9-]+:[0-9a-f]+$")]


class SnapshotRequest(WireModel):
    """A published snapshot to serve."""

    identity: SnapshotIdentity = Field(description="The snapshot's name (printable, no spaces).")
    source: str = Field(
        min_length=1,
        max_length=8192,
        description="Where it is: a path the server can read (a checkpoint folder or file, a "
        "delta file, or a delta version folder), or an http(s) URL of one file (a presigned "
        "object-store URL is one).",
    )
    base: SnapshotIdentity | None = Field(
        default=None,
        description="The snapshot a delta builds on (required for a delta; 409 unless it is "
        "the one served).",
    )
    model: UpdatedModel = Field(default="policy")
    cache: Literal["reset", "keep"] = Field(
        default="reset",
        description="Prefix caches of the previous weights: dropped ('reset'), or kept and "
        "reused under the new ones ('keep'; engines without a prefix cache ignore it).",
    )
    pause: PauseMode = Field(default="keep", description=PAUSE_MODES_DOC)
    digest: Digest | None = Field(
        default=None,
        description="The digest the weights must have once it is applied "
        "(rlserve_client.weight_delta.weights_digest): refused before anything is written "
        "(409) if they would not.",
    )

    def ask(self) -> SnapshotAsk:
        return SnapshotAsk(
            identity=self.identity,
            source=self.source,
            model=self.model,
            base=self.base,
            cache=self.cache,
            pause=self.pause,
            digest=self.digest,
        )


class ReplicaWeights(WireModel):
    replica: str | None = Field(description="Which replica (null on a server of its own).")
    version: int = Field(description="The version served (-1: the replica did not answer).")
    digest: str | None
    snapshot: str | None = Field(description="The published snapshot served, if one is.")
    stage: Literal["serving", "fetching", "loading"] = Field(
        description="Where a snapshot load this replica received stands."
    )
    last_error: str | None = Field(description="Why its last snapshot load failed, if it did.")


class ServedSnapshots(WireModel):
    model: UpdatedModel
    replicas: list[ReplicaWeights]

    @classmethod
    def of(cls, model: str, served: list[ServedWeights]) -> ServedSnapshots:
        return cls(
            model=model,  # type: ignore[arg-type]
            replicas=[
                ReplicaWeights(
                    replica=s.replica,
                    version=s.version,
                    digest=s.digest,
                    snapshot=s.snapshot,
                    stage=s.stage,
                    last_error=_shown(s.last_error),
                )
                for s in served
            ],
        )


def _shown(error: Failure | str | None) -> str | None:
    """A recorded failure, as rlserve's routes word it."""
    return failure_error(error).message if isinstance(error, Failure) else error


class RestoreWeightsRequest(UpdateOptions):
    model: UpdatedModel = Field(default="policy", description=MODEL_DOC)


class WeightsUpdated(WireModel):
    model: UpdatedModel
    version: int = Field(
        description="The version `model` serves after the update (the one it published, "
        "unless it pushed a LoRA adapter)."
    )
    policy_version: int
    reference_version: int
    num_tensors: int
    num_bytes: int
    seconds: float = Field(description="Time the update held generation and scoring paused.")
    total_seconds: float = Field(description="Time the whole update took.")
    adapter: str | None = Field(
        default=None,
        description="The LoRA adapter the update pushed (then `adapter_version` "
        "is its new version, and the model's versions are as they were).",
    )
    adapter_version: int | None = None
    digest: str | None = Field(
        default=None,
        description="The digest of the model's weights after the update (of its tensors' "
        "checksums: rlserve_client.weight_delta.weights_digest computes it from a trainer's "
        "own); null when the engine cannot show its weights (vLLM after a collective transfer).",
    )
    sent_bytes: int | None = Field(
        default=None,
        description="For a delta: the bytes its compressed changes took, against num_bytes "
        "of tensors it rebuilt.",
    )
    snapshot: str | None = Field(
        default=None, description="The published snapshot now served, if the update was one."
    )

    @classmethod
    def of(cls, applied: Applied) -> WeightsUpdated:
        adapter = applied.adapter
        return cls(
            model=applied.model,  # type: ignore[arg-type]
            version=applied.version,
            policy_version=applied.versions.policy,
            reference_version=applied.versions.reference,
            num_tensors=applied.num_tensors,
            num_bytes=applied.num_bytes,
            seconds=applied.paused_s,
            total_seconds=applied.total_s,
            adapter=adapter.name if adapter is not None else None,
            adapter_version=adapter.version if adapter is not None else None,
            digest=applied.digest,
            sent_bytes=applied.sent_bytes,
            snapshot=applied.snapshot,
        )


class PauseRequest(WireModel):
    mode: PauseMode = Field(default="keep", description=PAUSE_MODES_DOC)


class ServingState(WireModel):
    paused: bool
    mode: PauseMode | None = Field(description="The mode of the current pause.")
    paused_by: Literal["request", "update"] | None = Field(
        description="'request': POST /v1/pause (until POST /v1/resume); 'update': a weight update."
    )
    in_flight_generations: int = Field(description="Generation requests inside (frozen ones too).")
    in_flight_scoring: int
    waiting: int = Field(description="Requests held back until the resume.")


class TransferTarget(WireModel):
    model: UpdatedModel = Field(default="policy", description="The model whose weights change.")


class TransferInit(TransferTarget):
    master_address: str = Field(
        min_length=1, max_length=253, description="Host of the trainer's rendezvous store."
    )
    master_port: int = Field(ge=1, le=65535, description="Port of the trainer's store.")
    world_size: int = Field(
        ge=2, le=4096, description="Trainer rank 0 plus the server ranks (GET for their count)."
    )
    rank_offset: int = Field(default=1, ge=1, description="The first server rank.")
    transport: TransportChoice = Field(
        default="auto", description="'auto': NCCL for a model on a GPU, gloo otherwise."
    )
    bucket_bytes: int = Field(
        default=BUCKET_BYTES,
        ge=1 << 16,
        le=16 << 30,
        description="The largest bucket an update may pack (one tensor alone may be larger).",
    )
    streams: int = Field(
        default=STREAMS, ge=1, le=64, description="Broadcasts in flight per bucket (its slices)."
    )
    timeout_s: float = Field(
        default=TIMEOUT_S,
        gt=0,
        le=3600,
        description="How long a join, a receive or a commit may wait for the trainer.",
    )
    rendezvous: RendezvousStyle = Field(
        default="rlserve",
        description="The group the trainer opened: rlserve's (rlserve_client.collective); "
        "vllm: vLLM's stateless group (what vLLM's trainer engine and TRL open); torch: "
        "torch.distributed's init_process_group recipe under `group_name` (what SGLang's "
        "trainers open). The last two broadcast each bucket whole (`streams` is ignored).",
    )
    group_name: str = Field(
        default="", max_length=256, description="The torch rendezvous' group name."
    )
    packing: Packing = Field(
        default="announced",
        description="How updates that name no `buckets` are cut: announced: one tensor per "
        "bucket; vllm: as vLLM's packed transfer cuts them (tensors until a bucket passes "
        "bucket_bytes).",
    )

    def join(self) -> Join:
        return Join(
            self.model,
            Connection(
                address=self.master_address,
                port=self.master_port,
                world_size=self.world_size,
                rank_offset=self.rank_offset,
                transport=self.transport,
                bucket_bytes=self.bucket_bytes,
                streams=self.streams,
                timeout_s=self.timeout_s,
                style=self.rendezvous,
                group_name=self.group_name,
                packing=self.packing,
            ),
        )


class AdapterPushTarget(WireModel):
    name: AdapterName
    config: dict[str, Any] | None = Field(
        default=None,
        description="The adapter's PEFT config (adapter_config.json's content): needed for a "
        "name not served yet (then served as a new adapter, owned by the caller); for a served "
        "one, its new config (default: the one it has).",
    )


class TransferStart(TransferTarget):
    adapter: AdapterPushTarget | None = Field(
        default=None,
        description="Push the tensors of this LoRA adapter of the policy instead of the "
        "model's weights (PEFT's names, as `get_peft_model_state_dict` gives them): at finish "
        "they become the adapter's next version, which new requests get while those in flight "
        "keep theirs (no pause). `model` is then the policy.",
    )


class TransferUpdate(TransferTarget):
    names: list[str] = Field(min_length=1, max_length=1 << 20)
    dtype_names: list[str] = Field(description="torch dtype names: float32, bfloat16, ...")
    shapes: list[list[int]]
    buckets: list[int] | None = Field(
        default=None,
        description="Tensors per bucket, in order (each bucket is their bytes back to back, "
        "broadcast as one buffer); default: one tensor per bucket.",
    )
    delta: bool = Field(
        default=False,
        description="The one tensor announced, 'rlserve.delta' (uint8, one dimension), is a "
        "delta of the served weights in rlserve's delta format (rlserve_client.weight_delta): "
        "each receiver stages it against its own weights and checks it as an uploaded delta "
        "before any commits (a wrong base is 409 at finish, on every replica).",
    )

    def announcement(self) -> Announcement:
        return Announcement(
            self.model, self.names, self.dtype_names, self.shapes, self.buckets, delta=self.delta
        )


class TransferFinish(TransferTarget, UpdateOptions):
    pass


class TransferState(WireModel):
    model: UpdatedModel
    state: Literal["idle", "joined", "updating"] = Field(
        description="idle: no group; joined: in the trainer's group; updating: between start "
        "and finish or abort."
    )
    server_ranks: int = Field(description="Ranks the server adds to the group.")
    transport: Transport | None = None
    world_size: int | None = None
    announced_bytes: int = Field(default=0, description="Bytes announced by this update so far.")
    last_error: str | None = Field(
        default=None, description="Why the last update failed (the group was closed)."
    )
    replicas: int = Field(
        default=1,
        description="The server replicas this state covers (several on Ray Serve: "
        "`server_ranks` counts all of theirs, and `state` is the least advanced one's).",
    )

    @classmethod
    def of(cls, status: TransferStatus) -> TransferState:
        return cls.model_validate(status, from_attributes=True)
