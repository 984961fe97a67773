"""What every replica of one deployment must serve: the checkpoint each model last committed
and whether serving is paused. A replica that starts (Ray restarting one, or scaling up)
applies it before it takes traffic, so it serves what the others serve.

It also orders updates: an update holds its model's lease from staging to the end of its
commit (a second one waits), and is decided here between the two phases, so a replica that
starts meanwhile catches up to it.

It keeps the LoRA adapters every replica serves the same way: each one's last version, with
its tensors, config, owner and pause, and the versions counted for each name (a name loaded
again after an unload goes on from its last one).

`Ledger` is what replicas ask; `LocalLedger` keeps the record in its own process (inside the
deployment's Ray actor, `app.deploy.ray_ledger`, or in a test)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.updates.protocol import PauseMode
from app.updates.session import SessionRecord, UpdateSession
from app.weights.shipment import Chunk, Held, Shipment, ShippedFile, ship_bytes


@dataclass(frozen=True)
class Decision:
    """An update every replica staged, for the ledger to record as `model`'s `version`: its
    checkpoint (a delta of the version before, if `delta`), published as `snapshot`, if
    `update_id` still holds the lease."""

    model: str
    update_id: str
    version: int
    shipment: Shipment
    delta: bool = False
    snapshot: str | None = None


@dataclass(frozen=True)
class Recorded:
    """A model's last committed version and what replays every update: a checkpoint (None:
    the weights every replica starts with), as `base_version`, then the updates after it in
    order (`chain`: deltas, which only apply on their base, and any update after one)."""

    version: int
    shipment: Shipment | None
    base_version: int = -1
    """The version `shipment` makes (-1: `version`)."""
    chain: tuple[tuple[int, Shipment], ...] = ()
    snapshot: str | None = None
    """The identity of the published snapshot `version` is (None: not one)."""

    @property
    def base(self) -> int:
        return self.version if self.base_version < 0 else self.base_version

    def chain_bytes(self) -> int:
        return sum(f.size for _, shipped in self.chain for f in shipped.files)


@dataclass(frozen=True)
class AdapterRecord:
    """A LoRA adapter's last version, as every replica serves it."""

    version: int
    owner: str
    """The owner id of the key that first served it."""
    config: dict[str, Any]
    source: str
    shipment: Shipment
    """One safetensors file of its tensors (PEFT's names)."""
    paused: PauseMode | None = None


@dataclass(frozen=True)
class LedgerState:
    models: dict[str, Recorded] = field(default_factory=dict)
    paused: PauseMode | None = None
    """The pause mode in force (None: serving)."""
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)
    """The adapters served, by name."""
    adapter_versions: dict[str, int] = field(default_factory=dict)
    """The last version counted for each adapter name, served or unloaded since."""


class Ledger(Protocol):
    async def acquire(self, model: str, update_id: str, lease_s: float) -> bool:
        """Take `model`'s update lease, unless another live update holds it."""

    async def decide(self, decision: Decision) -> bool:
        """Record `decision`, if its update still holds the lease."""

    async def rebase(self, model: str, update_id: str, version: int, shipment: Shipment) -> bool:
        """Record the whole checkpoint `shipment` as `model`'s `version` in place of its
        chain, if `update_id` still holds the lease."""

    async def release(self, model: str, update_id: str) -> None: ...

    async def record_pause(self, mode: PauseMode | None) -> None: ...

    async def record_adapter(self, name: str, record: AdapterRecord | None) -> None:
        """`record` as adapter `name`'s last version (None: unloaded)."""

    async def record_adapter_pause(self, name: str, mode: PauseMode | None) -> None: ...

    async def state(self) -> LedgerState: ...

    async def session(self) -> UpdateSession:
        """The dialect update session open over the deployment (`app.updates.session`)."""

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        """`SessionRecord.swap`, in the one place every replica writes: atomic."""

    async def reset_session(self) -> None: ...

    async def tidy(self) -> int:
        """Remove what earlier deployments of this application left; how many."""


class LocalLedger:
    """The ledger's record in this process. `keep` holds a chunk for as long as the ledger
    needs it (the sender's chunks may die with the sender)."""

    def __init__(self, keep: Callable[[bytes], Chunk] = Held) -> None:
        self.keep = keep
        self.latest: dict[str, Recorded] = {}
        self.leases: dict[str, tuple[str, float]] = {}  # model: (update id, expiry)
        self.paused: PauseMode | None = None
        self.update_session = SessionRecord()
        self.adapters: dict[str, AdapterRecord] = {}
        self.adapter_versions: dict[str, int] = {}

    async def acquire(self, model: str, update_id: str, lease_s: float) -> bool:
        now = time.monotonic()
        held = self.leases.get(model)
        if held is not None and held[0] != update_id and held[1] > now:
            return False
        self.leases[model] = (update_id, now + lease_s)
        return True

    async def decide(self, decision: Decision) -> bool:
        """The ledger keeps its own copy: the update merged over the ones before it, so one
        checkpoint replays them all; a delta (and any update after one, until a `rebase`)
        joins the chain after that checkpoint."""
        model, update_id = decision.model, decision.update_id
        if not self._holds(model, update_id):
            return False
        before = self.latest.get(model)
        if decision.delta or (before is not None and before.chain):
            kept = await self._kept(decision.shipment)
            base, base_version = (before.shipment, before.base) if before else (None, 0)
            chain = (*(before.chain if before else ()), (decision.version, kept))
            record = Recorded(decision.version, base, base_version, chain, decision.snapshot)
        else:
            merged_in = await self._merged(before.shipment if before else None, decision.shipment)
            record = Recorded(decision.version, merged_in, snapshot=decision.snapshot)
        if not self._holds(model, update_id):  # the lease ran out meanwhile
            return False
        self.latest[model] = record
        return True

    async def rebase(self, model: str, update_id: str, version: int, shipment: Shipment) -> bool:
        if not self._holds(model, update_id):
            return False
        kept = await self._kept(shipment)
        if not self._holds(model, update_id):
            return False
        before = self.latest.get(model)
        self.latest[model] = Recorded(version, kept, snapshot=before.snapshot if before else None)
        return True

    def _holds(self, model: str, update_id: str) -> bool:
        return self.leases.get(model, ("",))[0] == update_id

    async def _merged(self, before: Shipment | None, update: Shipment) -> Shipment:
        """A whole update is kept as it is (copied chunk by chunk); a partial one is merged
        into one file with the tensors before it."""
        if before is None or await _names(before) <= await _names(update):
            return await self._kept(update)
        return ship_bytes(merged(await before.whole(), await update.whole()), self.keep)

    async def _kept(self, shipment: Shipment) -> Shipment:
        """The ledger's own copy of `shipment`, chunk by chunk."""
        kept = []
        for shipped in shipment.files:
            chunks = [self.keep(await chunk.fetch()) for chunk in shipped.chunks]
            kept.append(ShippedFile(shipped.name, shipped.size, tuple(chunks)))
        return Shipment(tuple(kept))

    async def release(self, model: str, update_id: str) -> None:
        if self._holds(model, update_id):
            del self.leases[model]

    async def record_pause(self, mode: PauseMode | None) -> None:
        self.paused = mode

    async def record_adapter(self, name: str, record: AdapterRecord | None) -> None:
        if record is None:
            self.adapters.pop(name, None)
            return
        self.adapters[name] = replace(record, shipment=await self._kept(record.shipment))
        self.adapter_versions[name] = record.version

    async def record_adapter_pause(self, name: str, mode: PauseMode | None) -> None:
        if (record := self.adapters.get(name)) is not None:
            self.adapters[name] = replace(record, paused=mode)

    async def state(self) -> LedgerState:
        return LedgerState(
            dict(self.latest), self.paused, dict(self.adapters), dict(self.adapter_versions)
        )

    async def session(self) -> UpdateSession:
        return self.update_session.current

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        return self.update_session.swap(serial, session)

    async def reset_session(self) -> None:
        self.update_session.reset()

    async def tidy(self) -> int:
        return 0


async def _names(shipment: Shipment) -> set[str]:
    """The tensor names in shipped safetensors files, from the chunks holding their headers."""
    names: set[str] = set()
    for shipped in shipment.files:
        head = b""
        for chunk in shipped.chunks:
            head += await chunk.fetch()
            if len(head) >= 8 and len(head) >= 8 + int.from_bytes(head[:8], "little"):
                break
        names |= tensor_names({shipped.name: head})
    return names


def merged(before: dict[str, bytes], update: dict[str, bytes]) -> dict[str, bytes]:
    """Checkpoint files (name to safetensors bytes) holding `before`'s tensors with
    `update`'s over them. An update that names every tensor `before` has (a whole model)
    is kept as it is; a partial one is merged into one file."""
    if tensor_names(before) <= tensor_names(update):
        return update
    from safetensors.torch import load, save

    tensors = {}
    for data in [*before.values(), *update.values()]:
        tensors.update(load(data))
    return {"model.safetensors": save(tensors)}


def tensor_names(files: dict[str, bytes]) -> set[str]:
    """The tensor names in safetensors files, from their headers (a little-endian u64
    length, then that much JSON)."""
    names: set[str] = set()
    for data in files.values():
        size = int.from_bytes(data[:8], "little")
        names |= set(json.loads(data[8 : 8 + size])) - {"__metadata__"}
    return names
