"""Collective weight transfer, per served model: the update steps over a joined group
(`app.updates.groups` joins and leaves them).

joined --start--> updating --update*--> --finish--> joined (committed)
                         \\--abort------------------> joined
Any failure of the trainer's side (gone, too slow, a bad tensor) drops the staged update; a
lost peer also closes the group (idle), since a collective cannot recover from it. Calls on
one model are serialized; the data of an update arrives in the background while serving goes
on, and only the commit pauses serving.

An update may instead carry a LoRA adapter of the policy (`AdapterPush`, named at start): the
policy's group brings its tensors, and finish serves them as the adapter's next version
(nothing pauses: requests in flight keep the version they started with)."""

from __future__ import annotations

import asyncio
import time

import safetensors.torch

from app.common.failures import (
    Conflict,
    Failure,
    NotFound,
    PeerFailed,
    TimedOut,
    Unsupported,
    invalid,
    recast,
)
from app.common.roles import Role
from app.engine.registry import ModelRegistry
from app.updates.adapters import AdapterCatalog, Serving
from app.updates.groups import Link, TransferGroups
from app.updates.outcome import updated
from app.updates.service import WeightsService
from app.updates.transfer_delta import check_announced, stage_received
from app.updates.types import AdapterPush, Announcement, Applied, Join, Publish, TransferStatus
from app.weights.checkpoint import check_layout
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import WeightTransfer
from app.weights.transport import Connection

ADAPTER_VERSIONS = "an adapter's versions are counted by the server: leave it out"
"""Why an adapter's push names no version."""
_FIRST_PUSH = "a first push over the transfer gives its config at start (adapter.config)"
_STARTED = {Role.ADAPTER_SOURCE: Role.ADAPTER_PUSH}
"""What an adapter's refusals name at start (`app.updates.adapters`' roles): the push itself."""
_RECEIVED = {Role.ADAPTER_SOURCE: Role.TENSOR_NAMES}
"""What they name at finish: the tensors announced."""


class TransferService:
    """The update steps of every served model over its group (`groups`)."""

    def __init__(
        self,
        registry: ModelRegistry,
        adapters: AdapterCatalog,
        *,
        listen_grace_s: float,
        idle_timeout_s: float | None = None,
        files: WeightsService | None = None,
    ) -> None:
        self.registry = registry
        self.adapters = adapters
        self.files = files
        """Stages and commits a delta received over the group (None: deltas refused)."""
        self.groups = TransferGroups(
            registry, listen_grace_s=listen_grace_s, idle_timeout_s=idle_timeout_s
        )

    # -- the group (`app.updates.groups`) ------------------------------------------------

    async def state(self, model: str) -> TransferStatus:
        return await self.groups.state(model)

    def ranks(self, model: str) -> int:
        return self.groups.ranks(model)

    async def init(self, join: Join) -> TransferStatus:
        return await self.groups.init(join)

    def stand_in_for(self, join: Join, ranks: int) -> None:
        self.groups.stand_in_for(join, ranks)

    async def trainer_gone(self, model: str) -> str | None:
        return await self.groups.trainer_gone(model)

    async def close(self, model: str) -> TransferStatus:
        return await self.groups.close(model)

    async def aclose(self) -> None:
        await self.groups.aclose()

    # -- the update steps --------------------------------------------------------------

    async def start(self, model: str, adapter: AdapterPush | None = None) -> TransferStatus:
        """Begin an update of `model`'s weights, or of `adapter` (a LoRA adapter of the
        policy, refused here when it cannot be pushed: before any tensor travels)."""
        if adapter is not None:
            self._check_adapter(model, adapter)
        async with self.groups.link(model) as (link, engine):
            self.groups.joined(link)
            await engine.start(adapter=adapter is not None)
            link.updating, link.announced, link.started_at = True, [], time.perf_counter()
            link.session += 1
            link.adapter = adapter
            link.delta, link.received_delta = False, None
        return await self.state(model)

    def _check_adapter(self, model: str, adapter: AdapterPush) -> None:
        if model != "policy":
            raise invalid(
                Role.ADAPTER_PUSH, f"adapters adapt the policy; the update names '{model}'"
            )
        with recast(_STARTED):
            self.adapters.check_push(adapter.name, adapter.caller)
        if adapter.config is None and adapter.name not in self.registry.adapters:
            raise NotFound(
                f"no adapter '{adapter.name}' is served; {_FIRST_PUSH}",
                role=Role.ADAPTER_CONFIG,
            )

    async def update(self, announced: Announcement) -> TransferStatus:
        async with self.groups.link(announced.model) as (link, engine):
            setup = self.groups.updating(link)
            names, dtypes, shapes = announced.names, announced.dtype_names, announced.shapes
            buckets = announced.buckets
            packing = announced.packing or setup.packing
            bucket_bytes = announced.bucket_bytes or setup.bucket_bytes
            expected = self.registry.weights(announced.model).weight_layout()
            if link.adapter is not None:
                expected = None  # (an adapter's: checked at finish)
            if announced.delta or link.delta:
                self._check_delta(link, announced)
                expected, packing, link.delta = None, "announced", True
            if packing == "in_band":
                plan = TransferPlan.in_band_plan(expected)
            else:
                if buckets is None and packing == "vllm":
                    buckets = TransferPlan.packed_like_vllm(shapes, dtypes, bucket_bytes)
                plan = TransferPlan.parse(names, dtypes, shapes, buckets, bucket_bytes)
                if expected is not None:
                    check_layout(plan.layout(), expected)
                if link.adapter is not None:  # (its rank: checked at finish)
                    sent = sum(p.nbytes for p in link.announced)
                    self.adapters.check_size(sent + plan.nbytes, role=Role.TENSOR_NAMES)
            await engine.update(plan)
            link.announced.append(plan)
            self.groups.spawn(self._watch(link, engine, setup, link.session))
        return await self.state(announced.model)

    def _check_delta(self, link: Link, announced: Announcement) -> None:
        """A delta is its update's one announcement, of a model's weights, where the server
        can stage it."""
        if link.adapter is not None or link.announced or not announced.delta:
            raise invalid(
                Role.DELTA,
                "a delta is its update's only announcement, and of a model's weights (start "
                "another update for other tensors or an adapter)",
            )
        if self.files is None:
            raise Unsupported("this server stages no deltas", role=Role.DELTA)
        self.files.delta_base(announced.model, Role.DELTA)  # (refused before bytes travel)
        check_announced(announced, self.files)

    def is_delta(self, model: str) -> bool:
        """Whether the open update of `model` is a delta (`app.updates.transfer_delta`)."""
        link = self.groups.current(model)
        return link is not None and link.delta

    async def _watch(
        self, link: Link, engine: WeightTransfer, setup: Connection, session: int
    ) -> None:
        """A trainer that dies or stalls mid-transfer may never call finish or abort: the
        failed receive drops the update (and the group) by itself. Other failures (a bad
        tensor) wait for finish to report them."""
        try:
            await _received(engine, setup)
        except (PeerFailed, TimedOut) as exc:
            async with link.lock:
                if link.updating and link.session == session:
                    await self.groups.drop(link, engine, exc)

    def pushing(self, model: str) -> AdapterPush | None:
        """The adapter the open update of `model` pushes, if it pushes one."""
        link = self.groups.current(model)
        return link.adapter if link is not None else None

    async def finish(
        self, model: str, publish: Publish, *, adapter_version: int | None = None
    ) -> Applied:
        """Wait for the announced data, then swap it in. (A replica of several takes the
        same two steps as `received` and `commit`, with every other replica between them;
        for an adapter, `received`, then this with the `adapter_version` every replica
        serves.)"""
        async with self.groups.link(model) as (link, engine):
            try:
                if link.adapter is not None and publish.version is not None:
                    raise invalid(Role.VERSION, ADAPTER_VERSIONS)
                self.registry.gate.next_version(
                    model, publish.version, restartable=publish.restartable
                )
            except BaseException as exc:
                await self.groups.drop(link, engine, exc)
                raise
            await self._receive_all(link, engine, model)
            if link.adapter is not None:
                return await self._serve_adapter(link, engine, link.adapter, adapter_version)
            return await self._commit(link, engine, model, publish)

    async def _serve_adapter(
        self, link: Link, engine: WeightTransfer, adapter: AdapterPush, version: int | None
    ) -> Applied:
        """What was received, as `adapter`'s next version (or `version`; the model is left as
        it is)."""
        try:
            data = await engine.checkpoint()
            tensors = await asyncio.to_thread(safetensors.torch.load, data)
            step = Serving(
                adapter.name,
                tensors,
                adapter.config,
                source="transfer",
                caller=adapter.caller,
                first=_FIRST_PUSH,
                version=version,
            )
            with recast(_RECEIVED):
                served = await self.adapters.serve(step)
        except BaseException as exc:
            await self.groups.drop(link, engine, exc)
            raise
        await engine.abort()  # (drops the staged tensors: the adapter holds its own)
        link.updating, link.adapter = False, None
        plans, link.announced = link.announced, []
        return updated(
            self.registry.versions,
            "policy",
            self.registry.versions["policy"],
            sum(len(p.tensors) for p in plans),
            sum(p.nbytes for p in plans),
            0.0,
            link.started_at,
            adapter=served,
        )

    async def received(self, model: str) -> int:
        """A replica's first phase of finish: every announced tensor arrived and passed its
        checks (else the update is dropped here); the version `model` serves now."""
        async with self.groups.link(model) as (link, engine):
            await self._receive_all(link, engine, model)
        return self.registry.versions[model]

    async def checkpoint(self, model: str) -> bytes:
        """What was received (after `received`) as one safetensors file."""
        async with self.groups.link(model) as (link, engine):
            self.groups.updating(link)
            if link.received_delta is not None:  # (a later replica replays the delta)
                return link.received_delta.blob
            return await engine.checkpoint()

    async def commit(self, model: str, publish: Publish) -> Applied:
        """A replica's second phase: swap in what was received, as `publish.version`."""
        async with self.groups.link(model) as (link, engine):
            self.groups.updating(link)
            return await self._commit(link, engine, model, publish)

    async def abandon(self, model: str, failure: Failure) -> None:
        """Drop the update because it failed elsewhere (another replica's `failure`); a lost
        or stuck peer ends the group here too, as it does there."""
        async with self.groups.link(model) as (link, engine):
            if link.updating:
                await self.groups.drop(link, engine, failure)

    async def _receive_all(self, link: Link, engine: WeightTransfer, model: str) -> None:
        setup = self.groups.updating(link)
        if not link.announced:
            raise Conflict("no update was announced since start", role=Role.MODEL)
        try:
            await _received(engine, setup)
            if link.delta and link.received_delta is None and self.files is not None:
                link.received_delta = await stage_received(engine, self.files, model)
        except BaseException as exc:
            await self.groups.drop(link, engine, exc)
            raise

    async def _commit(
        self, link: Link, engine: WeightTransfer, model: str, publish: Publish
    ) -> Applied:
        if (received := link.received_delta) is not None and self.files is not None:
            try:
                applied = await self.files.commit_delta(
                    received.staged, received.header, model, publish, link.started_at
                )
            except BaseException as exc:
                await self.groups.drop(link, engine, exc)
                raise
            await engine.abort()  # (drops the received bytes)
            link.updating, link.announced, link.delta, link.received_delta = False, [], False, None
            return applied
        try:
            async with self.registry.writing(model, publish.commit()) as (target, version):
                paused_at = time.perf_counter()
                await engine.commit(version)
                names = [t.name for p in link.announced for t in p.tensors]
                if any(p.in_band for p in link.announced):  # (named over the group)
                    await self.registry.digests.record_all(model, target)
                else:
                    await self.registry.digests.record(model, target, names)
                paused = time.perf_counter() - paused_at
        except BaseException as exc:
            await self.groups.drop(link, engine, exc)
            raise
        link.updating = False
        plans, link.announced = link.announced, []
        return updated(
            self.registry.versions,
            model,
            version,
            sum(len(p.tensors) for p in plans),
            sum(p.nbytes for p in plans),
            paused,
            link.started_at,
            digest=self.registry.digests.of(model),
        )

    async def abort(self, model: str) -> TransferStatus:
        async with self.groups.link(model) as (link, engine):
            await engine.abort()
            link.updating, link.announced, link.adapter = False, [], None
        return await self.state(model)


async def _received(engine: WeightTransfer, setup: Connection) -> None:
    """Wait for the announced data; a lost or stuck trainer is a PeerFailed or TimedOut."""
    try:
        await engine.received(setup.timeout_s)
    except Failure:
        raise
    except Exception as exc:
        raise _peer_failure("receiving the weights", exc, setup.timeout_s) from exc


def _peer_failure(doing: str, exc: Exception, timeout_s: float) -> Failure:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    if isinstance(exc, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower():
        return TimedOut(f"{doing} did not complete within {timeout_s:g} s ({text})")
    return PeerFailed(f"{doing} failed: {text}")
