"""The deployment's ledger (`app.deploy.ledger`) as a detached Ray actor, one per deployment
generation: `build` draws a generation id each time the application is deployed, and a deploy
starts from the base weights (as a restarted server does); the first replica of a generation
removes the ledgers of earlier ones. The committed checkpoints' chunks are Ray objects the
actor owns, so they outlive the replica that received the update."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import ray

from app.deploy.ledger import AdapterRecord, Decision, LedgerState, LocalLedger
from app.updates.protocol import PauseMode
from app.updates.session import UpdateSession
from app.weights.shipment import Shipment

PREFIX = "rlserve-ledger"


@dataclass(frozen=True)
class RayChunk:
    """A chunk in Ray's object store (owned by whoever put it there)."""

    ref: Any  # ray.ObjectRef[bytes]

    async def fetch(self) -> bytes:
        data: bytes = await self.ref
        return data


def put(data: bytes) -> RayChunk:
    return RayChunk(ray.put(data))


@ray.remote(num_cpus=0, max_restarts=0)
class WeightLedger:
    """The record itself (an async actor: fetching chunks never blocks the other calls)."""

    def __init__(self) -> None:
        self.book = LocalLedger(keep=put)

    async def acquire(self, model: str, update_id: str, lease_s: float) -> bool:
        return await self.book.acquire(model, update_id, lease_s)

    async def decide(self, decision: Decision) -> bool:
        return await self.book.decide(decision)

    async def rebase(self, model: str, update_id: str, version: int, shipment: Shipment) -> bool:
        return await self.book.rebase(model, update_id, version, shipment)

    async def release(self, model: str, update_id: str) -> None:
        await self.book.release(model, update_id)

    async def record_pause(self, mode: PauseMode | None) -> None:
        await self.book.record_pause(mode)

    async def record_adapter(self, name: str, record: AdapterRecord | None) -> None:
        await self.book.record_adapter(name, record)

    async def record_adapter_pause(self, name: str, mode: PauseMode | None) -> None:
        await self.book.record_adapter_pause(name, mode)

    async def state(self) -> LedgerState:
        return await self.book.state()

    async def session(self) -> UpdateSession:
        return await self.book.session()

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        return await self.book.swap_session(serial, session)

    async def reset_session(self) -> None:
        await self.book.reset_session()


class RayLedger:
    """`app.deploy.ledger.Ledger` over this deployment generation's actor (created by the
    first replica that asks)."""

    def __init__(self, app_name: str, generation: str) -> None:
        self.app_name = app_name
        self.name = f"{PREFIX}-{app_name}-{generation}"

    def _actor(self) -> Any:
        return WeightLedger.options(  # type: ignore[attr-defined]
            name=self.name, lifetime="detached", get_if_exists=True
        ).remote()

    async def acquire(self, model: str, update_id: str, lease_s: float) -> bool:
        held: bool = await self._actor().acquire.remote(model, update_id, lease_s)
        return held

    async def decide(self, decision: Decision) -> bool:
        decided: bool = await self._actor().decide.remote(decision)
        return decided

    async def rebase(self, model: str, update_id: str, version: int, shipment: Shipment) -> bool:
        rebased: bool = await self._actor().rebase.remote(model, update_id, version, shipment)
        return rebased

    async def release(self, model: str, update_id: str) -> None:
        await self._actor().release.remote(model, update_id)

    async def record_pause(self, mode: PauseMode | None) -> None:
        await self._actor().record_pause.remote(mode)

    async def record_adapter(self, name: str, record: AdapterRecord | None) -> None:
        await self._actor().record_adapter.remote(name, record)

    async def record_adapter_pause(self, name: str, mode: PauseMode | None) -> None:
        await self._actor().record_adapter_pause.remote(name, mode)

    async def state(self) -> LedgerState:
        state: LedgerState = await self._actor().state.remote()
        return state

    async def session(self) -> UpdateSession:
        session: UpdateSession = await self._actor().session.remote()
        return session

    async def swap_session(self, serial: int, session: UpdateSession) -> UpdateSession | None:
        swapped: UpdateSession | None = await self._actor().swap_session.remote(serial, session)
        return swapped

    async def reset_session(self) -> None:
        await self._actor().reset_session.remote()

    async def tidy(self) -> int:
        return await asyncio.to_thread(self._remove_earlier)

    def _remove_earlier(self) -> int:
        """Kill the ledgers earlier generations of this application left; how many."""
        namespace = ray.get_runtime_context().namespace
        earlier = [
            actor["name"]
            for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["namespace"] == namespace
            and actor["name"].startswith(f"{PREFIX}-{self.app_name}-")
            and actor["name"] != self.name
        ]
        for name in earlier:
            with contextlib.suppress(ValueError):  # another replica removed it first
                ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        return len(earlier)
