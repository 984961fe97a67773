"""The weight controls the routes use: pause and resume serving, load or upload a checkpoint,
restore the weights a model started with, and the collective transfer's steps. One server
implements them alone (`app.updates.local.LocalWeights`); a replica of several implements
them over every replica as one (`app.deploy.replicated.ReplicatedWeights`)."""

from __future__ import annotations

from typing import Protocol

from app.common.caller import Caller
from app.common.failures import Conflict
from app.common.roles import Role
from app.engine.adapter_gate import AdapterGateState
from app.engine.gate import GateState
from app.engine.registry import ModelRegistry
from app.updates.session import UpdateSession
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
from app.weights.lora import LoraAdapter


class WeightsControl(Protocol):
    async def open(self) -> None:
        """Before serving: clear what a killed server left behind."""

    async def aclose(self) -> None:
        """Leave any transfer group; nothing is applied after this."""

    def version(self) -> Versions:
        """The versions this server serves."""

    async def pause(self, mode: PauseMode) -> GateState:
        """Pause serving; the state afterwards (once in-flight work met `mode`)."""

    async def resume(self) -> GateState: ...

    async def load(
        self, path: str, model: str, publish: Publish, *, role: Role = Role.CHECKPOINT
    ) -> Applied:
        """Apply a checkpoint from a path the server can read, whole or not at all; refusals
        name `role`, what the path is to the request."""

    async def pull_published(
        self, local: str | None, source: str, target: int, stream: str = "slime"
    ) -> str:
        """Bring the local checkpoint `local` (None: one of the server's own) to version
        `target` of those published under `source` as `stream` ('slime' or 'skyrl') lays
        them out (`app.weights.published`), without touching serving; where it is."""

    async def load_snapshot(self, ask: SnapshotAsk) -> Applied:
        """Serve a published snapshot (`app.updates.snapshots`), on every replica, or refuse
        it and serve on the current one."""

    async def served(self, model: str) -> list[ServedWeights]:
        """What each replica serves of `model` (its version, digest and snapshot) and where
        its last snapshot load stands."""

    async def restore(self, model: str, publish: Publish) -> Applied:
        """Serve again the weights the model started with (read from where they came from),
        as a new version."""

    async def upload(self, body: Streamed, model: str, publish: Publish) -> Applied:
        """Apply a checkpoint streamed in as `body`, whole or not at all."""

    async def load_adapter(self, name: str, path: str, *, caller: Caller) -> LoraAdapter:
        """Serve the LoRA adapter in folder `path` as `name` (a served name: its next
        version, if `caller` may change it). Refusals name the roles of
        `app.updates.adapters`."""

    async def push_adapter(self, name: str, body: Streamed, *, caller: Caller) -> LoraAdapter:
        """New tensors of adapter `name`, streamed as one safetensors file: its next version
        (or its first, owned by `caller`, when the file's metadata carries its config), to new
        requests (those in flight keep theirs). Whether `caller` may push to `name`, and
        whether a new name fits the bounds, is checked before a chunk is read; `size` as for
        `upload`."""

    async def unload_adapter(self, name: str, *, caller: Caller) -> LoraAdapter:
        """Stop serving adapter `name` to new requests; requests in flight finish with it."""

    async def pause_adapter(
        self, name: str, mode: PauseMode, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        """Pause adapter `name` alone; the policy and other adapters serve on."""

    async def resume_adapter(
        self, name: str, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]: ...

    async def transfer_state(self, model: str) -> TransferStatus: ...

    async def transfer_init(self, join: Join) -> TransferStatus:
        """Join the trainer's group."""

    async def transfer_start(
        self, model: str, adapter: AdapterPush | None = None
    ) -> TransferStatus:
        """Begin an update of `model`'s weights, or of a LoRA adapter of the policy."""

    async def transfer_update(self, announced: Announcement) -> TransferStatus:
        """Check announced tensors and start receiving them."""

    async def transfer_finish(self, model: str, publish: Publish) -> Applied:
        """Swap in what was received, whole or not at all."""

    async def transfer_abort(self, model: str) -> TransferStatus: ...

    async def transfer_close(self, model: str) -> TransferStatus: ...

    async def transfer_prune(self, model: str) -> TransferStatus:
        """Close `model`'s group if its trainer is gone (nothing accepts connections at its
        rendezvous, no update under way): a trainer that ended without leaving its group never
        fails the next update that is not the group's."""

    async def session(self) -> UpdateSession:
        """The update session a dialect's trainer has open (`app.updates.session`): the same
        record on every replica of a deployment."""

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        """`session` in place of the one read at `serial`, unless another call wrote it
        since (then None): `SessionRecord.swap`."""


async def abort_in_flight(registry: ModelRegistry, weights: WeightsControl) -> int:
    """End every in-flight generation at its next token (each returns what it produced,
    finish_reason 'abort'); how many there were. A paused server holds them already."""
    state = registry.gate.state()
    if state.paused:
        raise Conflict(
            "serving is paused: in-flight generations are held until the resume; resume first",
            role=Role.ABORT,
        )
    await weights.pause("abort")
    await weights.resume()
    return state.in_flight_generations
