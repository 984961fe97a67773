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
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from app.common.failures import Conflict, Failure, InvalidInput, PeerFailed
from app.common.roles import Role
from app.deploy.answers import cause, combined, of_kind, serving
from app.deploy.ledger import Decision
from app.deploy.replica import (
    Commit,
    Committed,
    Ranks,
    Refusal,
    ReplicaEndpoint,
    Stage,
)
from app.deploy.replicated_adapters import ReplicatedAdapters
from app.engine.gate import GateState, resolve_version
from app.updates.session import UpdateSession
from app.updates.snapshots import load_snapshot
from app.updates.types import (
    AdapterPush,
    Announcement,
    Applied,
    Join,
    PauseMode,
    Publish,
    ServedWeights,
    SnapshotAsk,
    Streamed,
    TransferStatus,
    Versions,
)
from app.weights.shipment import Shipment, ship_bytes

logger = logging.getLogger(__name__)


class ReplicatedWeights(ReplicatedAdapters):
    """`app.updates.control.WeightsControl` over every replica, `local` being this one's (its
    LoRA adapters' part: `app.deploy.replicated_adapters`)."""

    _catching: asyncio.Task[None] | None = None
    """The catch-up under way in the background (`lagging`)."""

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
        versions = self.local.registry.versions
        for model, recorded in state.models.items():
            if versions.get(model, recorded.version) >= recorded.version:
                continue
            files, last = self.local.files, recorded.snapshot
            if recorded.shipment is not None and versions[model] < recorded.base:
                named = last if recorded.base == recorded.version else None
                await files.adopt(model, recorded.base, recorded.shipment, named)
            for version, step in recorded.chain:  # deltas, each on the one before
                if versions[model] < version:
                    named = last if version == recorded.version else None
                    await files.adopt(model, version, step, named)
            logger.info("caught up with version %d of %s", recorded.version, model)
        for name, adapter in state.adapters.items():
            await self._catch_up_adapter(name, adapter)
        if state.paused is not None:
            await self.local.pause(state.paused)
            logger.info("paused (%s), as every replica is", state.paused)

    async def lagging(self) -> str | None:
        """Why this replica does not serve what the ledger says every replica serves (None:
        it does, or an update is under way here); a replica that fell behind (its commit
        failed where the others' succeeded) starts catching up in the background, and its
        health check fails until it has (Ray Serve routes nothing to it meanwhile)."""
        if self.local.files.has_any_staged():
            return None
        state = await self.replicas.ledger.state()
        versions = self.local.registry.versions
        behind = [
            f"{model} at version {versions.get(model, 0)}, not {recorded.version}"
            for model, recorded in state.models.items()
            if versions.get(model, 0) < recorded.version
        ]
        if not behind:
            return None
        if self._catching is None or self._catching.done():
            self._catching = asyncio.create_task(self.catch_up())
        return "behind the other replicas, catching up: " + "; ".join(behind)

    # -- checkpoint updates ----------------------------------------------------------------

    async def load(
        self, path: str, model: str, publish: Publish, *, role: Role = Role.CHECKPOINT
    ) -> Applied:
        """Read once here, shipped to every replica (a delta folder as one file)."""
        self.local.registry.weights(model)  # (a model not served is refused first)
        put, files = self.replicas.put, self.local.files
        delta = await files.delta_file(Path(path), role)
        if isinstance(delta, Path):
            shipment = await files.ship({"delta.safetensors": delta}, put, role, self.chunk_bytes)
        elif delta is not None:
            shipment = ship_bytes({"delta.safetensors": delta}, put, self.chunk_bytes)
        if delta is not None:
            return await self._update(shipment, model, publish, role, delta=True)
        shipment = await files.ship_checkpoint(path, put, self.chunk_bytes, role=role)
        return await self._update(shipment, model, publish, role)

    async def pull_published(
        self, local: str | None, source: str, target: int, stream: str = "slime"
    ) -> str:
        """Here alone: the update that loads it ships it to every replica."""
        return await self.local.pull_published(local, source, target, stream)

    async def load_snapshot(self, ask: SnapshotAsk) -> Applied:
        """Fetched and checked here, shipped to every replica as any update is."""
        return await load_snapshot(self, self.local.files, self.local.loads, ask)

    async def served(self, model: str) -> list[ServedWeights]:
        self.local.registry.weights(model)
        answers = await self.replicas.each(ReplicaEndpoint.weights_served, model)
        return [
            answer
            if isinstance(answer, ServedWeights)
            else ServedWeights(model, -1, None, None, last_error=answer.raised)
            for answer in answers
        ]

    async def restore(self, model: str, publish: Publish) -> Applied:
        """Read here from where the model started, shipped to every replica."""
        path = await self.local.files.origin(model)
        return await self.load(str(path), model, publish)

    async def upload(self, body: Streamed, model: str, publish: Publish) -> Applied:
        """Streamed to disk here, then shipped to every replica from there."""
        self.local.registry.weights(model)  # (a model not served is refused before the body)
        files = self.local.files
        async with files.received(body, files.upload_limit()) as path:
            delta = await files.delta_file(path, Role.UPLOAD) is not None
            shipped = {"model.safetensors": path}
            shipment = await files.ship(shipped, self.replicas.put, Role.UPLOAD, self.chunk_bytes)
        return await self._update(shipment, model, publish, Role.UPLOAD, delta=delta)

    async def _update(
        self, shipment: Shipment, model: str, publish: Publish, role: Role, delta: bool = False
    ) -> Applied:
        each = self.replicas.each

        async def stage(update_id: str) -> list[int | Refusal]:
            return await each(
                ReplicaEndpoint.weights_stage,
                Stage(update_id, shipment, model, role, publish.expect_digest),
            )

        async def shipped() -> Shipment:
            return shipment

        async def abort(update_id: str, _: Failure) -> None:
            await each(ReplicaEndpoint.weights_abort, update_id)

        async def commit(update_id: str, chosen: Publish) -> list[Committed | Refusal]:
            return await each(ReplicaEndpoint.weights_commit, Commit(update_id, model, chosen))

        return await self._transaction(
            model, publish, stage=stage, shipment=shipped, abort=abort, commit=commit, delta=delta
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
        delta: bool = False,
    ) -> Applied:
        """Stage on every replica (each answers the version it serves, or its refusal),
        decide in the ledger (with the checkpoint a later replica catches up to), then commit
        on every replica, or abort on every one; the model's lease is held throughout. A
        `delta` joins the ledger's chain, which is replaced by this replica's own checkpoint
        once it holds more bytes than one."""
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
            version, lineage_named = current + 1, None
            if problem is None and publish.version is not None:
                try:
                    version, lineage_named = resolve_version(
                        model,
                        current,
                        self.local.registry.gate.lineage(model),
                        publish.version,
                        restartable=publish.restartable,
                    )
                except Conflict as exc:
                    problem = exc
            if problem is None and not await ledger.decide(
                Decision(model, update_id, version, await shipment(), delta, publish.snapshot)
            ):
                problem = Conflict(
                    f"the update of '{model}' took over {self.wait_s:g} s and lost its turn to "
                    "a later one; send it again",
                    role=Role.MODEL,
                )
            if problem is not None:
                await abort(update_id, problem)
                raise problem
            chosen = publish.decided(version, lineage_named)
            committed = await commit(update_id, chosen)
            if delta and not any(isinstance(r, Refusal) for r in committed):
                await self._compact(model, update_id, version)
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

    async def _compact(self, model: str, update_id: str, version: int) -> None:
        """Once `model`'s chain in the ledger holds more bytes than its whole checkpoint, the
        checkpoint this replica serves (at `version`, just committed) replaces it: a replica
        that starts later replays at most about twice a checkpoint's bytes."""
        recorded = (await self.replicas.ledger.state()).models.get(model)
        files = self.local.files
        if recorded is None or recorded.chain_bytes() <= files.checkpoint_bytes(model):
            return
        whole = await files.served_checkpoint(model)
        shipment = ship_bytes({"model.safetensors": whole}, self.replicas.put, self.chunk_bytes)
        if await self.replicas.ledger.rebase(model, update_id, version, shipment):
            logger.info("the ledger holds version %d of %s whole again", version, model)

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
        offsets, next_rank = {}, join.connection.rank_offset
        for replica in sorted(of_kind(counted, Ranks), key=lambda r: r.replica):
            offsets[replica.replica] = next_rank
            next_rank += replica.ranks
        if next_rank > join.connection.world_size:
            # (no replica joined: stand-ins let the trainer's rendezvous go, as on one server)
            self.local.transfers.stand_in_for(join, next_rank - join.connection.rank_offset)
            raise InvalidInput(
                f"{join.connection.world_size} leaves no room for the "
                f"{next_rank - join.connection.rank_offset} ranks of {len(counted)} replicas from "
                f"rank_offset {join.connection.rank_offset} (GET /v1/weights/transfer counts them)",
                role=Role.GROUP_SIZE,
            )
        joined = await each(ReplicaEndpoint.transfer_join, join, offsets)
        if failed := [r for r in joined if isinstance(r, Refusal)]:
            await each(ReplicaEndpoint.transfer_close, join.model)
            raise cause(failed).failure(f"{len(failed)} of {len(joined)} replicas could not join")
        if join.model == "policy":
            await self.replicas.ledger.reset_session()  # (a replaced group's is gone)
        return combined(join.model, joined)

    async def transfer_start(
        self, model: str, adapter: AdapterPush | None = None
    ) -> TransferStatus:
        """A start that fails on one replica is aborted on all."""
        states = await self.replicas.each(ReplicaEndpoint.transfer_start, model, adapter)
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
        received (a replica that starts later was not in the group). An adapter's tensors are
        served as its next version instead."""
        if (pushed := self.local.transfers.pushing(model)) is not None:
            return await self._finish_adapter_push(model, publish, pushed)
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

        delta = self.local.transfers.is_delta(model)  # (joins the ledger's chain)
        return await self._transaction(
            model,
            publish,
            stage=received,
            shipment=shipment,
            abort=abandon,
            commit=commit,
            delta=delta,
        )

    async def transfer_abort(self, model: str) -> TransferStatus:
        states = await self.replicas.each(ReplicaEndpoint.transfer_abort, model)
        return combined(model, states)

    async def transfer_prune(self, model: str) -> TransferStatus:
        """Every replica joined the same group: its rendezvous, seen from here, says whether
        its trainer is gone (then every replica leaves it)."""
        if (reason := await self.local.transfers.trainer_gone(model)) is not None:
            logger.warning("closing the weight-transfer group of '%s': %s", model, reason)
            return await self.transfer_close(model)
        return await self.transfer_state(model)

    async def transfer_close(self, model: str) -> TransferStatus:
        states = await self.replicas.each(ReplicaEndpoint.transfer_close, model)
        if model == "policy":
            await self.replicas.ledger.reset_session()
        return combined(model, states)

    async def session(self) -> UpdateSession:
        """The ledger's record: whichever replica the trainer's next call reaches reads it."""
        return await self.replicas.ledger.session()

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        """Compare-and-set in the ledger: two replicas' calls never undo each other's."""
        return await self.replicas.ledger.swap_session(serial, session)
