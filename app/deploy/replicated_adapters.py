"""The LoRA adapters of a replica of several: every replica serves each adapter at the same
version, which the deployment's ledger counts and records (with the shipped tensors, for a
replica that starts later); an adapter's lease orders its versions. `ReplicatedWeights`
(`app.deploy.replicated`) is the rest of the weight controls over the same replicas."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Concatenate, ParamSpec, Protocol, TypeVar

from app.common.caller import Caller
from app.common.failures import Conflict, Failure, PeerFailed, invalid
from app.common.roles import Role
from app.deploy.answers import cause
from app.deploy.ledger import AdapterRecord, Ledger
from app.deploy.replica import AdapterServe, Refusal, ReplicaEndpoint, serve_shipped_adapter
from app.engine.adapter_gate import AdapterGateState
from app.updates.local import LocalWeights
from app.updates.transfer import ADAPTER_VERSIONS
from app.updates.types import AdapterPush, Applied, PauseMode, Publish, Streamed
from app.weights.lora import LoraAdapter
from app.weights.lora_layout import read_folder, upload_bytes
from app.weights.shipment import CHUNK_BYTES, Chunk, Shipment, ship_bytes

logger = logging.getLogger(__name__)
ADAPTER_FILE = "adapter.safetensors"
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


class ReplicatedAdapters:
    """The adapter controls over every replica, `local` being this one's."""

    def __init__(
        self, local: LocalWeights, replicas: Replicas, wait_s: float, chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        self.local = local
        self.replicas = replicas
        self.wait_s = wait_s
        """How long an update waits for another one to finish (and holds its lease)."""
        self.chunk_bytes = chunk_bytes

    async def _acquire(
        self, lease: str, update_id: str, what: str | None = None, role: Role = Role.MODEL
    ) -> None:
        """Wait for the update lease `lease` (a model's, or an adapter's: `what`), which
        another update holds while it runs."""
        deadline = time.monotonic() + self.wait_s
        while not await self.replicas.ledger.acquire(lease, update_id, self.wait_s):
            if time.monotonic() > deadline:
                raise Conflict(
                    f"another update of {what or repr(lease)} has been running for over "
                    f"{self.wait_s:g} s; try again later",
                    role=role,
                )
            await asyncio.sleep(0.2)

    async def _catch_up_adapter(self, name: str, record: AdapterRecord) -> None:
        """Serve the adapter's recorded version, owned by its owner, paused if it is."""
        owner = Caller(owner=record.owner, admin=True)
        served = self.local.registry.adapters.get(name)
        if served is None or served.version < record.version:
            step = AdapterServe(
                name=name,
                shipment=record.shipment,
                version=record.version,
                caller=owner,
                source=record.source,
                keep_layout=False,
            )
            await serve_shipped_adapter(self.local, step, record.config)
            logger.info("caught up with version %d of adapter %s", record.version, name)
        if record.paused is not None:
            await self.local.adapters.pause(name, record.paused, owner)

    async def load_adapter(self, name: str, path: str, *, caller: Caller) -> LoraAdapter:
        """Read here, shipped to every replica."""
        self.local.adapters.check_push(name, caller)
        config, tensors = await asyncio.to_thread(read_folder, Path(path), Role.ADAPTER_SOURCE)
        data = await asyncio.to_thread(upload_bytes, config, tensors)
        shipment = ship_bytes({ADAPTER_FILE: data}, self.replicas.put, self.chunk_bytes)
        step = AdapterServe(
            name=name, shipment=shipment, version=0, caller=caller, source=path, keep_layout=False
        )
        return await self._serve_adapter(step)

    async def push_adapter(self, name: str, body: Streamed, *, caller: Caller) -> LoraAdapter:
        """Streamed to disk here, then shipped to every replica from there."""
        adapters = self.local.adapters
        adapters.check_push(name, caller)
        files = self.local.files
        async with files.received(body, adapters.upload_limit()) as path:
            put = self.replicas.put
            shipment = await files.ship(
                {ADAPTER_FILE: path}, put, Role.ADAPTER_SOURCE, self.chunk_bytes
            )
        step = AdapterServe(
            name=name,
            shipment=shipment,
            version=0,
            caller=caller,
            source="upload",
            keep_layout=True,
        )
        return await self._serve_adapter(step)

    async def _serve_adapter(self, step: AdapterServe) -> LoraAdapter:
        """Every replica serves the shipped tensors as the adapter's next version."""

        async def serve(version: int) -> list[int | Refusal]:
            versioned = replace(step, version=version)
            return await self.replicas.each(ReplicaEndpoint.adapter_serve, versioned)

        await self._next_adapter_version(step.name, serve, step.source, step.shipment)
        return self.local.registry.adapters[step.name]

    async def _next_adapter_version(
        self,
        name: str,
        serve: Callable[[int], Awaitable[list[T | Refusal]]],
        source: str,
        shipment: Shipment,
    ) -> list[T]:
        """`serve` the adapter's next version on every replica: the version the ledger
        counts, which then records it with `shipment` (for a replica that starts later);
        the adapter's lease orders its versions."""
        ledger, update_id = self.replicas.ledger, uuid.uuid4().hex
        lease = f"adapter:{name}"
        await self._acquire(lease, update_id, f"adapter '{name}'", Role.ADAPTER)
        try:
            last = (await ledger.state()).adapter_versions.get(name)
            version = last + 1 if last is not None else 0
            served = await serve(version)
            adapter = self.local.registry.adapters.get(name)
            owner = self.local.adapters.owner(name)
            if adapter is not None and adapter.version == version and owner is not None:
                record = AdapterRecord(version, owner, adapter.config, source, shipment)
                await ledger.record_adapter(name, record)
        finally:
            await ledger.release(lease, update_id)
        return _every_one(served, "serve the adapter's new version")

    async def unload_adapter(self, name: str, *, caller: Caller) -> LoraAdapter:
        self.local.adapters.check_change(name, caller)
        adapter = self.local.registry.adapters[name]
        unloaded = await self.replicas.each(ReplicaEndpoint.adapter_unload, name, caller)
        if any(not isinstance(r, Refusal) for r in unloaded):
            await self.replicas.ledger.record_adapter(name, None)
        _every_one(unloaded, "unload the adapter")
        return adapter

    async def pause_adapter(
        self, name: str, mode: PauseMode, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        """Every replica pauses it (the ledger first: a replica starting meanwhile pauses it
        too)."""
        self.local.adapters.check_change(name, caller)
        await self.replicas.ledger.record_adapter_pause(name, mode)
        states = await self.replicas.each(ReplicaEndpoint.adapter_pause, name, mode, caller)
        return self.local.registry.adapters[name], _adapter_states(states, "pause the adapter")

    async def resume_adapter(
        self, name: str, *, caller: Caller
    ) -> tuple[LoraAdapter, AdapterGateState]:
        self.local.adapters.check_change(name, caller)
        await self.replicas.ledger.record_adapter_pause(name, None)
        states = await self.replicas.each(ReplicaEndpoint.adapter_resume, name, caller)
        return self.local.registry.adapters[name], _adapter_states(states, "resume the adapter")

    async def _finish_adapter_push(
        self, model: str, publish: Publish, pushed: AdapterPush
    ) -> Applied:
        """Every replica received the adapter's tensors and checked them; then each serves
        them as the adapter's next version (nothing pauses). Any refusal before that drops
        the update on every replica."""
        each = self.replicas.each
        problem: Failure | None = None
        if publish.version is not None:
            problem = invalid(Role.VERSION, ADAPTER_VERSIONS)
        else:
            received = await each(ReplicaEndpoint.transfer_received, model)
            if refused := [r for r in received if isinstance(r, Refusal)]:
                problem = cause(refused).failure(
                    f"{len(refused)} of {len(received)} replicas refused it"
                )
        if problem is not None:
            await each(ReplicaEndpoint.transfer_abandon, model, Refusal.of(problem))
            raise problem
        data = await self.local.transfers.checkpoint(model)
        shipment = ship_bytes({ADAPTER_FILE: data}, self.replicas.put, self.chunk_bytes)

        async def serve(version: int) -> list[Applied | Refusal]:
            return await each(ReplicaEndpoint.transfer_serve_adapter, model, version)

        served = await self._next_adapter_version(pushed.name, serve, "transfer", shipment)
        return served[0]


def _every_one(answers: list[T | Refusal], doing: str) -> list[T]:
    """The replicas' answers to one adapter step: refused by all (the adapter's name, its
    owner, its tensors), the refusal; by some, a PeerFailed saying how many."""
    refused = [a for a in answers if isinstance(a, Refusal)]
    if len(refused) == len(answers):
        raise cause(refused).failure(f"{len(refused)} of {len(answers)} replicas refused it")
    if refused:
        raise PeerFailed(
            f"{len(refused)} of {len(answers)} replicas failed to {doing}, the others did: "
            f"{cause(refused).message}"
        )
    return [a for a in answers if not isinstance(a, Refusal)]


def _adapter_states(answers: list[AdapterGateState | Refusal], doing: str) -> AdapterGateState:
    """Every replica's state of one adapter, as one: its mode, and the requests in flight
    and waiting on all of them."""
    states = _every_one(answers, doing)
    return AdapterGateState(
        paused=states[0].paused,
        in_flight=sum(s.in_flight for s in states),
        waiting=sum(s.waiting for s in states),
    )
