"""One replica's side of the steps `app.deploy.replicated` takes over every replica: each is a
method of `ReplicaEndpoint` taking and answering typed, picklable values, and running this
replica's own local step (`app.updates.local.LocalWeights`). A failure is answered as a
`Refusal`, so it crosses process boundaries with its kind, message and field intact."""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from app.common.caller import Caller
from app.common.failures import Conflict, Failure, PeerFailed
from app.common.roles import Role
from app.engine.adapter_gate import AdapterGateState
from app.engine.gate import GateState
from app.updates.adapters import Serving
from app.updates.local import LocalWeights
from app.updates.types import (
    AdapterPush,
    Announcement,
    Applied,
    Join,
    PauseMode,
    Publish,
    ServedWeights,
    TransferStatus,
)
from app.weights.lora import LoraAdapter
from app.weights.lora_layout import read_upload
from app.weights.shipment import Shipment

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Refusal:
    """A replica's failure, as data: a `Failure` pickles whole (its kind, role, field and
    message), so it crosses process boundaries as it was raised."""

    raised: Failure

    @property
    def message(self) -> str:
        return self.raised.message

    @classmethod
    def of(cls, exc: Failure) -> Refusal:
        return cls(exc)

    @classmethod
    def unreachable(cls, exc: BaseException) -> Refusal:
        """A replica that could not answer (gone, or failed outside the domain's failures)."""
        return cls(PeerFailed(str(exc) or type(exc).__name__))

    def failure(self, context: str | None = None) -> Failure:
        """The failure it raised there (same kind, same role or field), `context` appended."""
        return self.raised.noted(context) if context is not None else copy.copy(self.raised)


@dataclass(frozen=True)
class Stage:
    update_id: str
    shipment: Shipment
    model: str
    role: Role
    """What the checkpoint is to the request (named in a refusal)."""
    expect_digest: str | None = None
    """The digest the weights must have once it is applied (`Publish.expect_digest`)."""


@dataclass(frozen=True)
class Commit:
    update_id: str
    model: str
    publish: Publish
    """The version every replica publishes, and the pause."""


@dataclass(frozen=True)
class Committed:
    applied: Applied | None
    """None: this replica started after the others staged the update, and caught up to it."""


@dataclass(frozen=True)
class AdapterServe:
    """A LoRA adapter's next version, for every replica to serve under one version."""

    name: str
    shipment: Shipment
    """One safetensors file of its tensors (PEFT's names), its config in the metadata or
    not (then the one it is served with)."""
    version: int
    caller: Caller
    source: str
    keep_layout: bool
    """Refuse other layers or shapes than the version served (a push); a load may change
    them."""


@dataclass(frozen=True)
class Ranks:
    replica: str
    ranks: int


async def serve_shipped_adapter(
    weights: LocalWeights, step: AdapterServe, config: dict[str, Any] | None = None
) -> LoraAdapter:
    """Serve `step`'s shipped tensors on this replica, with `config` (default: the one in
    the file's metadata, else the one the adapter is served with)."""
    async with weights.files.unpacked(step.shipment) as file:
        shipped_config, tensors = await asyncio.to_thread(read_upload, file, Role.ADAPTER_SOURCE)
    serving = Serving(
        step.name,
        tensors,
        config or shipped_config,
        source=step.source,
        caller=step.caller,
        version=step.version,
        keep_layout=step.keep_layout,
    )
    return await weights.adapters.serve(serving)


def answered(step: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T | Refusal]]:
    """A step whose failure is answered as a Refusal."""

    @functools.wraps(step)
    async def answer(*args: P.args, **kwargs: P.kwargs) -> T | Refusal:
        try:
            return await step(*args, **kwargs)
        except Failure as exc:
            return Refusal.of(exc)

    return answer


class ReplicaEndpoint:
    """What the other replicas may ask of this one. The replica supplies `local_weights` and
    `replica_id` (on Ray Serve, the deployment class; in tests, a fake)."""

    def local_weights(self) -> LocalWeights:
        raise NotImplementedError

    def replica_id(self) -> str:
        raise NotImplementedError

    # -- one checkpoint update: stage, then commit or abort ------------------------------

    @answered
    async def weights_stage(self, stage: Stage) -> int:
        """Copy and check the shipped checkpoint; the version this replica serves now."""
        files = self.local_weights().files
        return await files.stage(
            stage.update_id, stage.shipment, stage.model, stage.role, stage.expect_digest
        )

    @answered
    async def weights_commit(self, commit: Commit) -> Committed:
        weights = self.local_weights()
        caught_up = weights.registry.versions[commit.model] == commit.publish.version
        if not weights.files.has_staged(commit.update_id) and caught_up:
            return Committed(None)
        return Committed(
            await weights.files.commit_staged(commit.update_id, commit.model, commit.publish)
        )

    @answered
    async def weights_served(self, model: str) -> ServedWeights:
        weights = self.local_weights()
        return weights.loads.served(weights.registry, model, self.replica_id())

    async def weights_abort(self, update_id: str) -> None:
        self.local_weights().files.abort_staged(update_id)

    # -- LoRA adapters ---------------------------------------------------------------------

    @answered
    async def adapter_serve(self, step: AdapterServe) -> int:
        """Serve the shipped tensors as the adapter's `step.version`; that version."""
        return (await serve_shipped_adapter(self.local_weights(), step)).version

    @answered
    async def adapter_unload(self, name: str, caller: Caller) -> int:
        """Stop serving the adapter to new requests; the version it had."""
        return (await self.local_weights().unload_adapter(name, caller=caller)).version

    @answered
    async def adapter_pause(self, name: str, mode: PauseMode, caller: Caller) -> AdapterGateState:
        return (await self.local_weights().pause_adapter(name, mode, caller=caller))[1]

    @answered
    async def adapter_resume(self, name: str, caller: Caller) -> AdapterGateState:
        return (await self.local_weights().resume_adapter(name, caller=caller))[1]

    # -- serving ---------------------------------------------------------------------------

    @answered
    async def serving_pause(self, mode: PauseMode) -> GateState:
        return await self.local_weights().pause(mode)

    @answered
    async def serving_resume(self) -> GateState:
        return await self.local_weights().resume()

    # -- the collective transfer -------------------------------------------------------------

    @answered
    async def transfer_state(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_state(model)

    @answered
    async def transfer_ranks(self, model: str) -> Ranks:
        return Ranks(self.replica_id(), self.local_weights().transfers.ranks(model))

    @answered
    async def transfer_join(self, join: Join, offsets: dict[str, int]) -> TransferStatus:
        """Join at this replica's rank offset (`offsets`: by replica id)."""
        if (offset := offsets.get(self.replica_id())) is None:
            raise Conflict(
                "the replicas changed while the group formed; init again", role=Role.MODEL
            )
        return await self.local_weights().transfer_init(join.at(offset))

    @answered
    async def transfer_start(self, model: str, adapter: AdapterPush | None) -> TransferStatus:
        return await self.local_weights().transfer_start(model, adapter)

    @answered
    async def transfer_update(self, announced: Announcement) -> TransferStatus:
        return await self.local_weights().transfer_update(announced)

    @answered
    async def transfer_abort(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_abort(model)

    @answered
    async def transfer_close(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_close(model)

    @answered
    async def transfer_received(self, model: str) -> int:
        """Every announced tensor arrived and passed its checks; the version served now."""
        return await self.local_weights().transfers.received(model)

    @answered
    async def transfer_commit(self, model: str, publish: Publish) -> Committed:
        weights = self.local_weights()
        state = await weights.transfers.state(model)
        caught_up = weights.registry.versions[model] == publish.version
        if state.state != "updating" and caught_up:
            return Committed(None)  # started after the others received it
        return Committed(await weights.transfers.commit(model, publish))

    @answered
    async def transfer_serve_adapter(self, model: str, version: int) -> Applied:
        """Serve what was received (after `transfer_received`) as the pushed adapter's
        `version`."""
        transfers = self.local_weights().transfers
        return await transfers.finish(model, Publish(), adapter_version=version)

    @answered
    async def transfer_abandon(self, model: str, reason: Refusal) -> None:
        """Drop the update, which failed on another replica for `reason`."""
        failure = reason.failure("on another replica")
        await self.local_weights().transfers.abandon(model, failure)
