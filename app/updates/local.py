"""The weight controls of one server: its serving gate, its checkpoint updates
(`app.updates.service`) and its collective transfers (`app.updates.transfer`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from app.common.caller import Caller
from app.common.roles import Role
from app.config_groups import WeightSettings
from app.engine.adapter_gate import AdapterGateState
from app.engine.gate import GateState
from app.engine.registry import ModelRegistry
from app.updates.adapters import AdapterCatalog
from app.updates.service import WeightsService
from app.updates.session import SessionRecord, UpdateSession
from app.updates.snapshots import Loads, load_snapshot
from app.updates.transfer import TransferService
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

logger = logging.getLogger(__name__)


class LocalWeights:
    """`app.updates.control.WeightsControl` on this server alone."""

    def __init__(self, registry: ModelRegistry, settings: WeightSettings, data_dir: Path) -> None:
        self.registry = registry
        self.adapters = AdapterCatalog(registry)
        self.files = WeightsService(registry, settings, data_dir)
        self.transfers = TransferService(
            registry,
            self.adapters,
            listen_grace_s=settings.rendezvous_grace_s,
            idle_timeout_s=settings.group_idle_timeout_s,
            files=self.files,
        )
        self._session = SessionRecord()
        self.loads = Loads()

    async def open(self) -> None:
        await asyncio.to_thread(self.files.clean_uploads)

    async def aclose(self) -> None:
        await self.transfers.aclose()

    def version(self) -> Versions:
        versions = self.registry.versions
        return Versions(policy=versions["policy"], reference=versions["reference"])

    async def pause(self, mode: PauseMode) -> GateState:
        return await self.registry.gate.pause(mode)

    async def resume(self) -> GateState:
        return await self.registry.gate.resume()

    async def load(
        self, path: str, model: str, publish: Publish, *, role: Role = Role.CHECKPOINT
    ) -> Applied:
        return await self.files.load(path, model, publish, role=role)

    async def pull_published(
        self, local: str | None, source: str, target: int, stream: str = "slime"
    ) -> str:
        place = Path(local) if local is not None else None
        return str(await self.files.pull(place, Path(source), target, stream))

    async def load_snapshot(self, ask: SnapshotAsk) -> Applied:
        return await load_snapshot(self, self.files, self.loads, ask)

    async def served(self, model: str) -> list[ServedWeights]:
        self.registry.weights(model)
        return [self.loads.served(self.registry, model, None)]

    async def restore(self, model: str, publish: Publish) -> Applied:
        path = await self.files.origin(model)
        return await self.load(str(path), model, publish)

    async def upload(self, body: Streamed, model: str, publish: Publish) -> Applied:
        return await self.files.upload(body, model, publish)

    async def load_adapter(self, name: str, path: str, *, caller: Caller) -> LoraAdapter:
        return await self.adapters.load(name, Path(path), caller)

    async def push_adapter(self, name: str, body: Streamed, *, caller: Caller) -> LoraAdapter:
        self.adapters.check_push(name, caller)  # before a byte of the body is read
        async with self.files.received(body, self.adapters.upload_limit()) as path:
            return await self.adapters.push(name, path, caller)

    async def unload_adapter(self, name: str, *, caller: Caller) -> LoraAdapter:
        return self.adapters.unload(name, caller)

    async def pause_adapter(
        self, name: str, mode: PauseMode, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        return await self.adapters.pause(name, mode, caller)

    async def resume_adapter(
        self, name: str, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        return await self.adapters.resume(name, caller)

    async def transfer_state(self, model: str) -> TransferStatus:
        return await self.transfers.state(model)

    async def transfer_init(self, join: Join) -> TransferStatus:
        status = await self.transfers.init(join)
        if join.model == "policy":
            self._session.reset()  # (a session of a group it replaced is gone)
        return status

    async def transfer_start(
        self, model: str, adapter: AdapterPush | None = None
    ) -> TransferStatus:
        return await self.transfers.start(model, adapter)

    async def transfer_update(self, announced: Announcement) -> TransferStatus:
        return await self.transfers.update(announced)

    async def transfer_finish(self, model: str, publish: Publish) -> Applied:
        return await self.transfers.finish(model, publish)

    async def transfer_abort(self, model: str) -> TransferStatus:
        return await self.transfers.abort(model)

    async def transfer_close(self, model: str) -> TransferStatus:
        status = await self.transfers.close(model)
        if model == "policy":
            self._session.reset()
        return status

    async def transfer_prune(self, model: str) -> TransferStatus:
        if (reason := await self.transfers.trainer_gone(model)) is not None:
            logger.warning("closing the weight-transfer group of '%s': %s", model, reason)
            return await self.transfer_close(model)
        return await self.transfers.state(model)

    async def session(self) -> UpdateSession:
        return self._session.current

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        return self._session.swap(serial, session)
