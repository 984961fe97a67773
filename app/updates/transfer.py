"""Collective weight transfer, per served model: the routes' state machine.

idle --init--> joined --start--> updating --update*--> --finish--> joined (committed)
                                       \\--abort------------------> joined
Any failure of the trainer's side (gone, too slow, a bad tensor) drops the staged update; a
lost peer also closes the group (idle), since a collective cannot recover from it. Calls on
one model are serialized; the data of an update arrives in the background while serving goes
on, and only the commit pauses serving.

A group never blocks the next trainer: an init finds the group there closed (and logs why) when
its trainer is gone (nothing accepts connections at its rendezvous any more), when it saw no
call for `idle_timeout_s` (the operator's setting; a sweep closes it then too), or when the
same trainer joins again (SGLang's group name, or the same rendezvous address). Otherwise the
init is refused, naming the route an admin closes it with.

An update may instead carry a LoRA adapter of the policy (`AdapterPush`, named at start): the
policy's group brings its tensors, and finish serves them as the adapter's next version
(nothing pauses: requests in flight keep the version they started with)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import safetensors.torch

from app.common.failures import (
    Conflict,
    Failure,
    InvalidInput,
    NotFound,
    PeerAbsent,
    PeerFailed,
    TimedOut,
    Unsupported,
    invalid,
    worded,
)
from app.engine.registry import ModelRegistry
from app.updates.adapters import AdapterCatalog, Serving
from app.updates.outcome import updated
from app.updates.service import WeightsService
from app.updates.transfer_delta import PARAM as DELTA_PARAM
from app.updates.transfer_delta import ReceivedDelta, check_announced, stage_received
from app.updates.types import AdapterPush, Announcement, Applied, Join, Publish, TransferStatus
from app.weights.checkpoint import check_layout
from app.weights.lora import ADAPTER_SOURCE
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import (
    JOIN_CLOSED,
    WeightTransfer,
    rendezvous_answers,
    rendezvous_listening,
)
from app.weights.transport import Connection, Transport, stand_in, stands_in

logger = logging.getLogger(__name__)


ADAPTER_VERSIONS = "an adapter's versions are counted by the server: leave it out"
"""Why an adapter's push names no version."""
_FIRST_PUSH = "a first push over the transfer gives its config at start (adapter.config)"
_STARTED_WORDS = {ADAPTER_SOURCE: "adapter"}
"""What an adapter's refusals name at start (`app.updates.adapters`' roles): the push itself."""
_RECEIVED_WORDS = {ADAPTER_SOURCE: "names"}
"""What they name at finish: the tensors announced."""


@dataclass
class _Link:
    """One model's transfer state."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    setup: Connection | None = None
    updating: bool = False
    started_at: float = 0.0
    announced: list[TransferPlan] = field(default_factory=list)
    last_error: str | None = None
    session: int = 0
    """Counts updates, so a watcher only acts on the update it watches."""
    adapter: AdapterPush | None = None
    """What the open update pushes, when it is an adapter."""
    last_call: float = 0.0
    """time.monotonic() of the trainer's last call on the group."""
    joining: asyncio.Event | None = None
    """Set while a join waits for the trainer's rendezvous to listen: a close sets it, and
    the join gives way at once (instead of the close waiting out the grace)."""
    delta: bool = False
    """The open update announced a delta of the served weights (`app.updates.
    transfer_delta`)."""
    received_delta: ReceivedDelta | None = None
    """That delta, once received and staged."""


class TransferService:
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
        self.listen_grace_s = listen_grace_s
        """How long a join waits for the trainer's rendezvous to listen (settings)."""
        self.idle_timeout_s = idle_timeout_s
        """A group that saw no call for this long is closed (None: never for idleness)."""
        self._links: dict[str, _Link] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def _engine(self, model: str) -> WeightTransfer:
        backend = self.registry.weights(model)
        if not backend.capabilities.weight_transfer:
            raise Unsupported(
                f"model: the {backend.info.backend} backend of '{model}' cannot receive weight "
                "transfers; use PUT /v1/weights or POST /v1/weights/load",
                param="model",
            )
        return backend.transfer()

    @contextlib.asynccontextmanager
    async def _link(self, model: str) -> AsyncIterator[tuple[_Link, WeightTransfer]]:
        """`model`'s link, locked; a call of the trainer's on the group."""
        engine = self._engine(model)
        link = self._links.setdefault(model, _Link())
        async with link.lock:
            link.last_call = time.monotonic()
            yield link, engine

    async def state(self, model: str) -> TransferStatus:
        """This server's state of `model`'s transfer."""
        engine = self._engine(model)
        link = self._links.get(model) or _Link()
        setup = link.setup
        return TransferStatus(
            model=model,
            state="updating" if link.updating else "joined" if setup else "idle",
            server_ranks=engine.ranks,
            transport=setup.transport if setup and setup.transport != "auto" else None,
            world_size=setup.world_size if setup else None,
            packing=setup.packing if setup else None,
            announced_bytes=sum(plan.nbytes for plan in link.announced),
            last_error=link.last_error,
        )

    def ranks(self, model: str) -> int:
        """The ranks `model`'s workers add to a group (a refusal if it cannot join one)."""
        return self._engine(model).ranks

    async def init(self, join: Join) -> TransferStatus:
        """Join the trainer's group at its connection's rank_offset, in place of a group whose
        trainer is gone or joins again (see the module's doc)."""
        idle_since = self._links[join.model].last_call if join.model in self._links else 0.0
        async with self._link(join.model) as (link, engine):
            try:
                setup = await self._room_for(link, engine, join, idle_since)
            except Failure:
                self.stand_in_for(join, engine.ranks)
                raise
            link.joining = closed = asyncio.Event()
            joining = JOIN_CLOSED.set(closed)  # (rendezvous_listening gives way when set)
            try:
                await asyncio.wait_for(engine.init(setup), timeout=join.connection.timeout_s + 5)
            except Failure:
                raise
            except Exception as exc:
                text = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
                raise PeerAbsent(
                    f"timeout_s: no trainer joined the group at {join.connection.address}:"
                    f"{join.connection.port} within {join.connection.timeout_s:g} s ({text})",
                    param="timeout_s",
                ) from exc
            finally:
                JOIN_CLOSED.reset(joining)
                link.joining = None
            link.setup, link.last_error = setup, None
        self._sweep_idle()
        return await self.state(join.model)

    async def _room_for(
        self, link: _Link, engine: WeightTransfer, join: Join, idle_since: float
    ) -> Connection:
        """The connection this server joins `join`'s group with, once the group it is in (if
        any) gave way; a refusal (before any rank of this server joined) otherwise."""
        if link.setup is not None:
            reason = await self._replaceable(link.setup, join, idle_since)
            if reason is None:
                setup = link.setup
                raise Conflict(
                    f"model: already in a weight-transfer group with the trainer at "
                    f"{setup.address}:{setup.port}, which still answers there; it leaves "
                    "it with its own close call, or an admin closes it (POST "
                    "/v1/weights/transfer/close)",
                    param="model",
                )
            logger.warning(
                "closing the weight-transfer group of '%s' (trainer at %s:%d): %s",
                join.model,
                link.setup.address,
                link.setup.port,
                reason,
            )
            await self._leave(link, engine)
        last = join.connection.rank_offset + engine.ranks
        if last > join.connection.world_size:
            raise InvalidInput(
                f"world_size: {join.connection.world_size} leaves no room for the server's "
                f"{engine.ranks} rank(s) from rank_offset {join.connection.rank_offset}",
                param="world_size",
            )
        return replace(
            join.connection, transport=self._transport(join), listen_grace_s=self.listen_grace_s
        )

    def stand_in_for(self, join: Join, ranks: int) -> None:
        """The server refused `join` before any of its ranks joined: stand-ins take its ranks
        at the trainer's rendezvous and leave at once (`app.weights.transport.stand_in`), in
        the background, so a trainer waiting there as rank 0 beside its request goes on to
        read the refusal instead of waiting out its own timeout."""
        connection = join.connection
        if connection.transport == "auto":  # (as the join would have resolved it)
            connection = replace(connection, transport=self._transport(join))
        if not stands_in(connection):
            return
        connection = replace(connection, listen_grace_s=self.listen_grace_s)
        first = connection.rank_offset
        taken = range(first, min(first + ranks, connection.world_size))

        async def stand_ins() -> None:
            try:
                await rendezvous_listening(connection)
                await asyncio.gather(*(asyncio.to_thread(stand_in, connection, r) for r in taken))
            except Exception as exc:  # (the trainer's own timeout is left to end its wait)
                logger.info("stand-ins at the refused group's rendezvous gave up: %s", exc)

        task = asyncio.create_task(stand_ins())
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _replaceable(self, setup: Connection, join: Join, idle_since: float) -> str | None:
        """Why the group of `setup` may give way to `join` (None: it may not)."""
        if setup.same_group(join.connection):
            return "the trainer joins the same group again (a restarted trainer)"
        idle = time.monotonic() - idle_since
        if self.idle_timeout_s is not None and idle > self.idle_timeout_s:
            return f"no call from its trainer for {idle:.0f} s (weights.group_idle_timeout_s)"
        if not await rendezvous_answers(setup.address, setup.port):
            return "its trainer is gone (nothing accepts connections at its rendezvous)"
        return None

    def _sweep_idle(self) -> None:
        """Close groups idle past `idle_timeout_s`, in the background (while it is set)."""
        if self.idle_timeout_s is None or self._sweeper is not None:
            return
        self._sweeper = asyncio.create_task(self._sweep())
        self._sweeper.add_done_callback(lambda _: setattr(self, "_sweeper", None))

    async def _sweep(self) -> None:
        while (timeout_s := self.idle_timeout_s) is not None:
            await asyncio.sleep(min(timeout_s / 4, 30.0))
            for model, link in list(self._links.items()):
                idle = time.monotonic() - link.last_call
                # (an update under way: its receive has a timeout of its own)
                if link.setup is None or link.updating or idle <= timeout_s or link.lock.locked():
                    continue
                async with link.lock:
                    if link.setup is None or time.monotonic() - link.last_call <= timeout_s:
                        continue
                    logger.warning(
                        "closing the weight-transfer group of '%s' (trainer at %s:%d): no call "
                        "from its trainer for %.0f s (weights.group_idle_timeout_s)",
                        model,
                        link.setup.address,
                        link.setup.port,
                        idle,
                    )
                    with contextlib.suppress(Exception):
                        await self._leave(link, self._engine(model))

    def _transport(self, join: Join) -> Transport:
        device = self.registry.weights(join.model).info.device
        on_gpu = device.startswith("cuda")
        if join.connection.transport == "auto":
            return "nccl" if on_gpu else "gloo"
        if join.connection.transport == "nccl" and not on_gpu:
            raise InvalidInput(
                f"transport: NCCL needs the model on a GPU; '{join.model}' is on {device}",
                param="transport",
            )
        return join.connection.transport

    async def start(self, model: str, adapter: AdapterPush | None = None) -> TransferStatus:
        """Begin an update of `model`'s weights, or of `adapter` (a LoRA adapter of the
        policy, refused here when it cannot be pushed: before any tensor travels)."""
        if adapter is not None:
            self._check_adapter(model, adapter)
        async with self._link(model) as (link, engine):
            self._joined(link)
            await engine.start(adapter=adapter is not None)
            link.updating, link.announced, link.started_at = True, [], time.perf_counter()
            link.session += 1
            link.adapter = adapter
            link.delta, link.received_delta = False, None
        return await self.state(model)

    def _check_adapter(self, model: str, adapter: AdapterPush) -> None:
        if model != "policy":
            raise invalid("adapter", f"adapters adapt the policy; the update names '{model}'")
        with worded(_STARTED_WORDS):
            self.adapters.check_push(adapter.name, adapter.caller)
        if adapter.config is None and adapter.name not in self.registry.adapters:
            raise NotFound(
                f"adapter.config: no adapter '{adapter.name}' is served; {_FIRST_PUSH}",
                param="adapter.config",
            )

    async def update(self, announced: Announcement) -> TransferStatus:
        async with self._link(announced.model) as (link, engine):
            setup = self._updating(link)
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
                    self.adapters.check_size(sent + plan.nbytes, param="names")
            await engine.update(plan)
            link.announced.append(plan)
            watcher = asyncio.create_task(self._watch(link, engine, setup, link.session))
            self._watchers.add(watcher)
            watcher.add_done_callback(self._watchers.discard)
        return await self.state(announced.model)

    def _check_delta(self, link: _Link, announced: Announcement) -> None:
        """A delta is its update's one announcement, of a model's weights, where the server
        can stage it."""
        if link.adapter is not None or link.announced or not announced.delta:
            raise invalid(
                DELTA_PARAM,
                "a delta is its update's only announcement, and of a model's weights (start "
                "another update for other tensors or an adapter)",
            )
        weights = self.registry.weights(announced.model)
        if self.files is None or not weights.capabilities.weight_deltas:
            raise Unsupported(
                f"{DELTA_PARAM}: the {weights.info.backend} engine takes full weights only (a "
                "delta is rebuilt from the served tensors, which it does not show)",
                param=DELTA_PARAM,
            )
        check_announced(announced, self.files)

    def is_delta(self, model: str) -> bool:
        """Whether the open update of `model` is a delta (`app.updates.transfer_delta`)."""
        link = self._links.get(model)
        return link is not None and link.delta

    async def _watch(
        self, link: _Link, engine: WeightTransfer, setup: Connection, session: int
    ) -> None:
        """A trainer that dies or stalls mid-transfer may never call finish or abort: the
        failed receive drops the update (and the group) by itself. Other failures (a bad
        tensor) wait for finish to report them."""
        try:
            await _received(engine, setup)
        except (PeerFailed, TimedOut) as exc:
            async with link.lock:
                if link.updating and link.session == session:
                    await self._drop(link, engine, exc)

    def pushing(self, model: str) -> AdapterPush | None:
        """The adapter the open update of `model` pushes, if it pushes one."""
        link = self._links.get(model)
        return link.adapter if link is not None else None

    async def finish(
        self, model: str, publish: Publish, *, adapter_version: int | None = None
    ) -> Applied:
        """Wait for the announced data, then swap it in. (A replica of several takes the
        same two steps as `received` and `commit`, with every other replica between them;
        for an adapter, `received`, then this with the `adapter_version` every replica
        serves.)"""
        async with self._link(model) as (link, engine):
            try:
                if link.adapter is not None and publish.version is not None:
                    raise invalid("version", ADAPTER_VERSIONS)
                self.registry.gate.next_version(
                    model, publish.version, restartable=publish.restartable
                )
            except BaseException as exc:
                await self._drop(link, engine, exc)
                raise
            await self._receive_all(link, engine, model)
            if link.adapter is not None:
                return await self._serve_adapter(link, engine, link.adapter, adapter_version)
            return await self._commit(link, engine, model, publish)

    async def _serve_adapter(
        self, link: _Link, engine: WeightTransfer, adapter: AdapterPush, version: int | None
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
            with worded(_RECEIVED_WORDS):
                served = await self.adapters.serve(step)
        except BaseException as exc:
            await self._drop(link, engine, exc)
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
        async with self._link(model) as (link, engine):
            await self._receive_all(link, engine, model)
        return self.registry.versions[model]

    async def checkpoint(self, model: str) -> bytes:
        """What was received (after `received`) as one safetensors file."""
        async with self._link(model) as (link, engine):
            self._updating(link)
            if link.received_delta is not None:  # (a later replica replays the delta)
                return link.received_delta.blob
            return await engine.checkpoint()

    async def commit(self, model: str, publish: Publish) -> Applied:
        """A replica's second phase: swap in what was received, as `publish.version`."""
        async with self._link(model) as (link, engine):
            self._updating(link)
            return await self._commit(link, engine, model, publish)

    async def abandon(self, model: str, failure: Failure) -> None:
        """Drop the update because it failed elsewhere (another replica's `failure`); a lost
        or stuck peer ends the group here too, as it does there."""
        async with self._link(model) as (link, engine):
            if link.updating:
                await self._drop(link, engine, failure)

    async def _receive_all(self, link: _Link, engine: WeightTransfer, model: str) -> None:
        setup = self._updating(link)
        if not link.announced:
            raise Conflict("no update was announced since start", param="model")
        try:
            await _received(engine, setup)
            if link.delta and link.received_delta is None and self.files is not None:
                link.received_delta = await stage_received(engine, self.files, model)
        except BaseException as exc:
            await self._drop(link, engine, exc)
            raise

    async def _commit(
        self, link: _Link, engine: WeightTransfer, model: str, publish: Publish
    ) -> Applied:
        if (received := link.received_delta) is not None and self.files is not None:
            try:
                applied = await self.files.commit_delta(
                    received.staged, received.header, model, publish, link.started_at
                )
            except BaseException as exc:
                await self._drop(link, engine, exc)
                raise
            await engine.abort()  # (drops the received bytes)
            link.updating, link.announced, link.delta, link.received_delta = False, [], False, None
            return applied
        try:
            async with self.registry.writing(model, **publish.gate()) as (target, version):
                paused_at = time.perf_counter()
                await engine.commit(version)
                names = [t.name for p in link.announced for t in p.tensors]
                if any(p.in_band for p in link.announced):  # (named over the group)
                    await self.registry.digests.record_all(model, target)
                else:
                    await self.registry.digests.record(model, target, names)
                paused = time.perf_counter() - paused_at
        except BaseException as exc:
            await self._drop(link, engine, exc)
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
        async with self._link(model) as (link, engine):
            await engine.abort()
            link.updating, link.announced, link.adapter = False, [], None
        return await self.state(model)

    async def trainer_gone(self, model: str) -> str | None:
        """Why `model`'s group has no trainer any more (None: it may): joined, no update
        under way, and nothing accepts connections at its rendezvous (a trainer that ended
        without leaving it, as prime-rl's broadcaster does)."""
        link = self._links.get(model)
        setup = None if link is None or link.updating else link.setup
        if setup is None or await rendezvous_answers(setup.address, setup.port):
            return None
        return (
            f"its trainer at {setup.address}:{setup.port} is gone (nothing accepts connections "
            "at its rendezvous)"
        )

    async def close(self, model: str) -> TransferStatus:
        if (link := self._links.get(model)) is not None and link.joining is not None:
            link.joining.set()  # a join still waiting for its trainer gives way
        async with self._link(model) as (link, engine):
            await self._leave(link, engine)
        return await self.state(model)

    @staticmethod
    async def _leave(link: _Link, engine: WeightTransfer) -> None:
        """Leave the group: whatever was staged is dropped."""
        link.setup, link.updating, link.announced, link.adapter = None, False, [], None
        await engine.close()

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for watcher in list(self._watchers):
            watcher.cancel()
        for model in list(self._links):
            with contextlib.suppress(Exception):
                await self.close(model)

    async def _drop(self, link: _Link, engine: WeightTransfer, exc: BaseException) -> None:
        """A failed finish: nothing was applied. A lost or stuck peer also ends the group, and
        so does any failure of an update named over the group (the trainer's broadcasts are
        then out of step with the receiver's)."""
        in_band = any(plan.in_band for plan in link.announced)
        link.updating, link.announced, link.adapter = False, [], None
        link.delta, link.received_delta = False, None
        link.last_error = f"{type(exc).__name__}: {exc}"
        await engine.abort()
        if isinstance(exc, PeerFailed | TimedOut) or in_band:
            await engine.close()
            link.setup = None
        logger.warning("weight transfer update dropped: %s", link.last_error)

    @staticmethod
    def _joined(link: _Link) -> Connection:
        if link.setup is None:
            raise Conflict("model: not in a weight-transfer group; call init first", param="model")
        return link.setup

    def _updating(self, link: _Link) -> Connection:
        setup = self._joined(link)
        if not link.updating:
            raise Conflict("model: no weight update in progress; call start first", param="model")
        return setup


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
