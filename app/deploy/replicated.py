"""The weight controls of a replica of several: every update reaches every replica, as one
transaction, with the deployment's ledger (app.deploy.ledger):

1. the replica that received the update ships the checkpoint in bounded chunks (an upload
   streamed to its disk first, a path read there, so it need only be readable there); it
   waits for the model's update lease, so updates never interleave;
2. every replica copies it into its own data, chunk by chunk, and checks it (layout, finite
   values), serving untouched;
3. if any replica failed, every replica drops its copy and the update is refused with that
   replica's error: all stay on the old version;
4. otherwise the ledger records the checkpoint under its new version (a replica starting from
   now on catches up to it), and every replica swaps it in under that version.

Step 4 only swaps checked tensors; a replica that still fails there (its device, say) is
reported, and the deployment's health check replaces it with one that catches up."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from app.common.caller import Caller
from app.common.failures import Conflict, Failure, InvalidInput, PeerFailed, Unsupported
from app.deploy.answers import cause, combined, of_kind, serving
from app.deploy.ledger import Ledger
from app.deploy.replica import Commit, Committed, Ranks, Refusal, ReplicaEndpoint, Stage
from app.engine.adapter_gate import AdapterGateState
from app.engine.gate import GateState
from app.updates.local import LocalWeights
from app.updates.session import UpdateSession
from app.updates.types import (
    AdapterPush,
    Announcement,
    Applied,
    Join,
    PauseMode,
    Publish,
    TransferStatus,
    Versions,
)
from app.weights.lora import LoraAdapter
from app.weights.shipment import CHUNK_BYTES, Chunk, Shipment, ship_bytes

logger = logging.getLogger(__name__)
P = ParamSpec("P")
T = TypeVar("T")


class Replicas(Protocol):
    """Every replica of the deployment (this one included), and its ledger."""

    @property
    def ledger(self) -> Ledger: ...

    async def each(
        self,
        step: Callable[Concatenate[ReplicaEndpoint, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[T | Refusal]:
        """`step` on every replica at once; a replica that could not answer is a Refusal."""
        ...

    def put(self, data: bytes) -> Chunk:
        """Leave a chunk where every replica can fetch it."""
        ...


class ReplicatedWeights:
    """`app.updates.control.WeightsControl` over every replica, `local` being this one's."""

    def __init__(
        self, local: LocalWeights, replicas: Replicas, wait_s: float, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.local = local
        self.replicas = replicas
        self.wait_s = wait_s
        """How long an update waits for another one to finish (and holds its lease)."""
        self.chunk_bytes = chunk_bytes

    async def open(self) -> None:
        await self.local.open()

    async def aclose(self) -> None:
        await self.local.aclose()

    def version(self) -> Versions:
        return self.local.version()

    async def catch_up(self) -> None:
        """Apply what the ledger says every replica serves (a starting replica, before it
        takes traffic): each model's last committed checkpoint, and a pause in force."""
        ledger = self.replicas.ledger
        if removed := await ledger.tidy():
            logger.info("removed %d ledgers of earlier deployments", removed)
        state = await ledger.state()
        for model, recorded in state.models.items():
            if self.local.registry.versions.get(model, recorded.version) < recorded.version:
                await self.local.files.adopt(model, recorded.version, recorded.shipment)
                logger.info("caught up with version %d of %s", recorded.version, model)
        if state.paused is not None:
            await self.local.pause(state.paused)
            logger.info("paused (%s), as every replica is", state.paused)

    # -- adapters ---------------------------------------------------------------------------

    async def load_adapter(
        self, name: str, path: str, param: str, *, name_param: str = "name", caller: Caller
    ) -> LoraAdapter:
        raise _no_adapters(param)

    async def push_adapter(
        self, name: str, chunks: AsyncIterator[bytes], *, caller: Caller
    ) -> LoraAdapter:
        raise _no_adapters("body")

    async def unload_adapter(self, name: str, param: str, *, caller: Caller) -> LoraAdapter:
        raise _no_adapters(param)

    async def pause_adapter(
        self, name: str, mode: PauseMode, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        raise _no_adapters("name")

    async def resume_adapter(
        self, name: str, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        raise _no_adapters("name")

    # -- checkpoint updates ----------------------------------------------------------------

    async def load(self, path: str, model: str, publish: Publish) -> Applied:
        """Read once here, shipped to every replica."""
        put, files = self.replicas.put, self.local.files
        shipment = await files.ship_checkpoint(path, put, self.chunk_bytes)
        return await self._update(shipment, model, publish, "path")

    async def restore(self, model: str, publish: Publish) -> Applied:
        """Read here from where the model started, shipped to every replica."""
        path = await self.local.files.origin(model)
        return await self.load(str(path), model, publish)

    async def upload(self, chunks: AsyncIterator[bytes], model: str, publish: Publish) -> Applied:
        """Streamed to disk here, then shipped to every replica from there."""
        files = self.local.files
        async with files.received(chunks) as path:
            shipped = {"model.safetensors": path}
            shipment = await files.ship(shipped, self.replicas.put, "body", self.chunk_bytes)
        return await self._update(shipment, model, publish, "body")

    async def _update(
        self, shipment: Shipment, model: str, publish: Publish, param: str
    ) -> Applied:
        each = self.replicas.each

        async def stage(update_id: str) -> list[int | Refusal]:
            return await each(
                ReplicaEndpoint.weights_stage, Stage(update_id, shipment, model, param)
            )

        async def shipped() -> Shipment:
            return shipment

        async def abort(update_id: str, _: Failure) -> None:
            await each(ReplicaEndpoint.weights_abort, update_id)

        async def commit(update_id: str, chosen: Publish) -> list[Committed | Refusal]:
            return await each(ReplicaEndpoint.weights_commit, Commit(update_id, model, chosen))

        return await self._transaction(
            model, publish, stage=stage, shipment=shipped, abort=abort, commit=commit
        )

    async def _transaction(
        self,
        model: str,
        publish: Publish,
        *,
        stage: Callable[[str], Awaitable[list[int | Refusal]]],
        shipment: Callable[[], Awaitable[Shipment]],
        abort: Callable[[str, Failure], Awaitable[None]],
        commit: Callable[[str, Publish], Awaitable[list[Committed | Refusal]]],
    ) -> Applied:
        """Stage on every replica (each answers the version it serves, or its refusal),
        decide in the ledger (with the checkpoint a later replica catches up to), then commit
        on every replica, or abort on every one; the model's lease is held throughout."""
        ledger, update_id = self.replicas.ledger, uuid.uuid4().hex
        await self._acquire(model, update_id)
        try:
            staged = await stage(update_id)
            refused = [r for r in staged if isinstance(r, Refusal)]
            current = max((r for r in staged if isinstance(r, int)), default=0)
            problem: Failure | None = None
            if refused:
                context = f"{len(refused)} of {len(staged)} replicas refused it"
                problem = cause(refused).failure(context)
            elif publish.version is not None and publish.version <= current:
                problem = Conflict(
                    f"version: {publish.version} is not above the current version {current} "
                    f"of '{model}'",
                    param="version",
                )
            version = publish.version or current + 1
            if problem is None and not await ledger.decide(
                model, update_id, version, await shipment()
            ):
                problem = Conflict(
                    f"the update of '{model}' took over {self.wait_s:g} s and lost its turn to "
                    "a later one; send it again",
                    param="model",
                )
            if problem is not None:
                await abort(update_id, problem)
                raise problem
            chosen = Publish(version=version, pause=publish.pause)
            committed = await commit(update_id, chosen)
        finally:
            await ledger.release(model, update_id)
        if failed := [r for r in committed if isinstance(r, Refusal)]:
            raise PeerFailed(
                f"{len(failed)} of {len(committed)} replicas failed to swap in version "
                f"{version} after all had checked it: {failed[0].message}"
            )
        return next(
            r.applied for r in committed if isinstance(r, Committed) and r.applied is not None
        )

    async def _acquire(self, model: str, update_id: str) -> None:
        """Wait for `model`'s update lease (another update holds it while it runs)."""
        deadline = time.monotonic() + self.wait_s
        while not await self.replicas.ledger.acquire(model, update_id, self.wait_s):
            if time.monotonic() > deadline:
                raise Conflict(
                    f"another update of '{model}' has been running for over {self.wait_s:g} s; "
                    "try again later",
                    param="model",
                )
            await asyncio.sleep(0.2)

    # -- serving ---------------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> GateState:
        """Every replica pauses (the ledger first: a replica starting meanwhile pauses too)."""
        await self.replicas.ledger.record_pause(mode)
        states = await self.replicas.each(ReplicaEndpoint.serving_pause, mode)
        return serving(states)

    async def resume(self) -> GateState:
        await self.replicas.ledger.record_pause(None)
        states = await self.replicas.each(ReplicaEndpoint.serving_resume)
        return serving(states)

    # -- the collective transfer's group over every replica ---------------------------------

    async def transfer_state(self, model: str) -> TransferStatus:
        """Every replica's state, as one."""
        states = await self.replicas.each(ReplicaEndpoint.transfer_state, model)
        return combined(model, states)

    async def transfer_init(self, join: Join) -> TransferStatus:
        """Every replica joins the trainer's group at once, at consecutive ranks from
        `rank_offset` (in replica id order); if any cannot, every replica leaves it."""
        each = self.replicas.each
        counted = await each(ReplicaEndpoint.transfer_ranks, join.model)
        if failed := [r for r in counted if isinstance(r, Refusal)]:
            raise failed[0].failure(f"{len(failed)} of {len(counted)} replicas")
        offsets, next_rank = {}, join.rank_offset
        for replica in sorted(of_kind(counted, Ranks), key=lambda r: r.replica):
            offsets[replica.replica] = next_rank
            next_rank += replica.ranks
        if next_rank > join.world_size:
            raise InvalidInput(
                f"world_size: {join.world_size} leaves no room for the "
                f"{next_rank - join.rank_offset} ranks of {len(counted)} replicas from "
                f"rank_offset {join.rank_offset} (GET /v1/weights/transfer counts them)",
                param="world_size",
            )
        joined = await each(ReplicaEndpoint.transfer_join, join, offsets)
        if failed := [r for r in joined if isinstance(r, Refusal)]:
            await each(ReplicaEndpoint.transfer_close, join.model)
            raise cause(failed).failure(f"{len(failed)} of {len(joined)} replicas could not join")
        return combined(join.model, joined)

    async def transfer_start(
        self, model: str, adapter: AdapterPush | None = None
    ) -> TransferStatus:
        """A start that fails on one replica is aborted on all."""
        if adapter is not None:
            raise _no_adapters("adapter")
        states = await self.replicas.each(ReplicaEndpoint.transfer_start, model)
        if any(isinstance(s, Refusal) for s in states):
            await self.replicas.each(ReplicaEndpoint.transfer_abort, model)
        return combined(model, states)

    async def transfer_update(self, announced: Announcement) -> TransferStatus:
        """Announce the tensors to every replica; if one refuses, every replica drops the
        update (the trainer sends nothing after a refusal)."""
        states = await self.replicas.each(ReplicaEndpoint.transfer_update, announced)
        if any(isinstance(s, Refusal) for s in states):
            await self.replicas.each(ReplicaEndpoint.transfer_abort, announced.model)
        return combined(announced.model, states)

    async def transfer_finish(self, model: str, publish: Publish) -> Applied:
        """The finish over every replica, as one transaction: all received and checked the
        update, then all swap it in under one version. The ledger keeps what this replica
        received (a replica that starts later was not in the group)."""
        each = self.replicas.each

        async def received(_: str) -> list[int | Refusal]:
            return await each(ReplicaEndpoint.transfer_received, model)

        async def shipment() -> Shipment:
            data = await self.local.transfers.checkpoint(model)
            return ship_bytes({"model.safetensors": data}, self.replicas.put, self.chunk_bytes)

        async def abandon(_: str, problem: Failure) -> None:
            reason = Refusal.of(problem)
            await each(ReplicaEndpoint.transfer_abandon, model, reason)

        async def commit(_: str, chosen: Publish) -> list[Committed | Refusal]:
            return await each(ReplicaEndpoint.transfer_commit, model, chosen)

        return await self._transaction(
            model, publish, stage=received, shipment=shipment, abort=abandon, commit=commit
        )

    async def transfer_abort(self, model: str) -> TransferStatus:
        states = await self.replicas.each(ReplicaEndpoint.transfer_abort, model)
        return combined(model, states)

    async def transfer_close(self, model: str) -> TransferStatus:
        states = await self.replicas.each(ReplicaEndpoint.transfer_close, model)
        return combined(model, states)

    async def session(self) -> UpdateSession:
        """The ledger's record: whichever replica the trainer's next call reaches reads it."""
        return await self.replicas.ledger.session()

    async def record_session(self, session: UpdateSession) -> None:
        await self.replicas.ledger.record_session(session)


def _no_adapters(param: str) -> Unsupported:
    return Unsupported(
        f"{param}: LoRA adapters are served by a single server for now, not across the "
        "replicas of a deployment",
        param=param,
    )
