"""What the weight controls (`app.updates.control.WeightsControl`) take and answer: plain
values, free of any wire format. rlserve's weight routes and vLLM's and SGLang's read their
requests into these and write their answers from them; the replicas of a deployment pass them
to each other as they are."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any, Literal

from app.common.caller import Caller
from app.common.failures import Failure
from app.engine.gate import Commit, PauseMode
from app.weights.transport import (
    BUCKET_BYTES,
    STREAMS,
    TIMEOUT_S,
    Connection,
    Packing,
    RendezvousStyle,
    Transport,
    TransportChoice,
)

__all__ = [
    "BUCKET_BYTES",
    "STREAMS",
    "TIMEOUT_S",
    "AdapterPush",
    "AdapterVersion",
    "Announcement",
    "Applied",
    "Connection",
    "Join",
    "Packing",
    "PauseMode",
    "Publish",
    "RendezvousStyle",
    "ServedWeights",
    "SnapshotAsk",
    "TransferStatus",
    "TransportChoice",
    "Versions",
]


@dataclass(frozen=True)
class Publish:
    """How a checked update is served: as `version` (None: the current one plus one; a
    version not above the current one is refused, unless `restartable`), while in-flight
    work meets `pause`."""

    version: int | None = None
    pause: PauseMode = "keep"
    restartable: bool = False
    """A `version` not above the current one is a trainer counting again (restarted from a
    checkpoint): served as the next version, in a new lineage (`app.engine.gate.Lineage`)."""
    lineage_named: int | None = None
    """Set once decided (by a deployment's coordinator): the update opens a new lineage, its
    trainer's count starting at this."""
    snapshot: str | None = None
    """The identity of the published snapshot it serves (`app.updates.snapshots`)."""
    cache: Literal["reset", "keep"] = "reset"
    """Whether prefix caches of the old weights are dropped (always, but for a snapshot that
    says 'keep')."""
    expect_digest: str | None = None
    """The digest the weights must have once it is applied: checked before anything is."""

    def commit(self) -> Commit:
        """What the serving gate takes of it."""
        keep_cache = self.cache == "keep"
        return Commit(
            self.pause,
            self.version,
            self.restartable,
            self.lineage_named,
            keep_cache,
            self.snapshot,
        )

    def decided(self, version: int, lineage_named: int | None) -> Publish:
        """This publish with its version (and lineage) settled."""
        return replace(self, version=version, restartable=False, lineage_named=lineage_named)


@dataclass(frozen=True)
class Versions:
    """The versions served."""

    policy: int
    reference: int


@dataclass(frozen=True)
class AdapterVersion:
    name: str
    version: int


@dataclass(frozen=True)
class Applied:
    """An update that was committed."""

    model: str
    versions: Versions
    """Served after it (an adapter's update leaves them as they were)."""
    version: int
    """The version `model` serves after it (the one it published, unless an adapter's)."""
    num_tensors: int
    num_bytes: int
    paused_s: float
    """How long generation and scoring were held for the swap."""
    total_s: float
    adapter: AdapterVersion | None = None
    """The LoRA adapter whose next version the update served, if it was one's."""
    digest: str | None = None
    """The digest of the model's weights after it (None: its engine cannot show them)."""
    sent_bytes: int | None = None
    """For a delta: the bytes its changes took (compressed), against `num_bytes` rebuilt."""
    snapshot: str | None = None
    """The published snapshot it served, if one."""


@dataclass(frozen=True)
class SnapshotAsk:
    """A published snapshot to serve: `identity`, the checkpoint or delta at `source` (a path
    the server can read, or an HTTP(S) URL of one file), a delta naming the snapshot it
    builds on (`base`)."""

    identity: str
    source: str
    model: str = "policy"
    base: str | None = None
    cache: Literal["reset", "keep"] = "reset"
    pause: PauseMode = "keep"
    digest: str | None = None
    """The digest the weights must have once it is applied (refused before, if not)."""


@dataclass(frozen=True)
class ServedWeights:
    """What one replica serves of a model, and where its last snapshot load stands."""

    model: str
    version: int
    digest: str | None
    snapshot: str | None
    """The published snapshot served (None: weights pushed another way, or the start)."""
    stage: Literal["serving", "fetching", "loading"] = "serving"
    last_error: Failure | str | None = None
    """Why its last snapshot load failed (a failure as raised: the route words its role)."""
    replica: str | None = None


@dataclass(frozen=True)
class Streamed:
    """A request body streamed in: its chunks, and the size its sender declared (None: not
    declared), refused before a chunk is read when over the limit."""

    chunks: AsyncIterator[bytes]
    size: int | None = None


@dataclass(frozen=True)
class AdapterPush:
    """An update that carries LoRA adapter `name`'s tensors, not the model's weights."""

    name: str
    config: dict[str, Any] | None
    """PEFT's config: needed for an adapter not served yet (else its own is kept)."""
    caller: Caller


@dataclass(frozen=True)
class Join:
    """A trainer's process group for `model`'s collective transfer, which the server's ranks
    join from the connection's `rank_offset`."""

    model: str
    connection: Connection

    def at(self, rank_offset: int) -> Join:
        return replace(self, connection=replace(self.connection, rank_offset=rank_offset))


@dataclass(frozen=True)
class Announcement:
    """Tensors the trainer broadcasts next, for `model`."""

    model: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    buckets: list[int] | None = None
    """Tensors per bucket, in order (None: one tensor per bucket, or as `packing` cuts them)."""
    packing: Packing | None = None
    """How tensors are cut into buckets when `buckets` says not (None: as the join said)."""
    bucket_bytes: int | None = None
    """The `packing`'s bucket size (None: the join's)."""
    delta: bool = False
    """The one tensor announced carries a delta of the served weights (`app.updates.
    transfer_delta`)."""


@dataclass(frozen=True)
class TransferStatus:
    """Where `model`'s collective transfer stands: idle (no group), joined, or updating
    (between start and finish or abort)."""

    model: str
    state: Literal["idle", "joined", "updating"]
    server_ranks: int
    transport: Transport | None = None
    world_size: int | None = None
    announced_bytes: int = 0
    last_error: str | None = None
    replicas: int = 1
    """The replicas it covers (their least advanced state, and all their ranks)."""
    packing: Packing | None = None
    """How the group's updates come (None: no group)."""
