"""Collective weight transfer, per served model: the groups a server's models join.

A model joins its trainer's group at init and leaves it at close; the update steps over a
joined group are `app.updates.transfer`'s. A group never blocks the next trainer: an init
finds the group there closed (and logs why) when its trainer is gone (nothing accepts
connections at its rendezvous any more), when it saw no call for `idle_timeout_s` (the
operator's setting; a sweep closes it then too), or when the same trainer joins again
(SGLang's group name, or the same rendezvous address). Otherwise the init is refused, naming
the route an admin closes it with. Calls on one model are serialized (`link`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from app.common.failures import (
    Conflict,
    Failure,
    InvalidInput,
    PeerAbsent,
    PeerFailed,
    TimedOut,
    Unsupported,
)
from app.common.roles import Role
from app.engine.registry import ModelRegistry
from app.updates.transfer_delta import ReceivedDelta
from app.updates.types import AdapterPush, Join, TransferStatus
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import (
    JOIN_CLOSED,
    WeightTransfer,
    rendezvous_answers,
    rendezvous_listening,
)
from app.weights.transport import Connection, Transport, stand_in, stands_in

logger = logging.getLogger(__name__)


@dataclass
class Link:
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


class TransferGroups:
    def __init__(
        self,
        registry: ModelRegistry,
        *,
        listen_grace_s: float,
        idle_timeout_s: float | None = None,
    ) -> None:
        self.registry = registry
        self.listen_grace_s = listen_grace_s
        """How long a join waits for the trainer's rendezvous to listen (settings)."""
        self.idle_timeout_s = idle_timeout_s
        """A group that saw no call for this long is closed (None: never for idleness)."""
        self._links: dict[str, Link] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background until it ends or `aclose` cancels it."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def current(self, model: str) -> Link | None:
        """`model`'s link, unlocked (None: it never joined a group)."""
        return self._links.get(model)

    def engine(self, model: str) -> WeightTransfer:
        backend = self.registry.weights(model)
        if not backend.capabilities.weight_transfer:
            raise Unsupported(
                f"the {backend.info.backend} backend of '{model}' cannot receive weight "
                "transfers; use PUT /v1/weights or POST /v1/weights/load",
                role=Role.MODEL,
            )
        return backend.transfer()

    @contextlib.asynccontextmanager
    async def link(self, model: str) -> AsyncIterator[tuple[Link, WeightTransfer]]:
        """`model`'s link, locked; a call of the trainer's on the group."""
        engine = self.engine(model)
        link = self._links.setdefault(model, Link())
        async with link.lock:
            link.last_call = time.monotonic()
            yield link, engine

    async def state(self, model: str) -> TransferStatus:
        """This server's state of `model`'s transfer."""
        engine = self.engine(model)
        link = self._links.get(model) or Link()
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
        return self.engine(model).ranks

    async def init(self, join: Join) -> TransferStatus:
        """Join the trainer's group at its connection's rank_offset, in place of a group whose
        trainer is gone or joins again (see the module's doc)."""
        idle_since = self._links[join.model].last_call if join.model in self._links else 0.0
        async with self.link(join.model) as (link, engine):
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
                    f"no trainer joined the group at {join.connection.address}:"
                    f"{join.connection.port} within {join.connection.timeout_s:g} s ({text})",
                    role=Role.GROUP_TIMEOUT,
                ) from exc
            finally:
                JOIN_CLOSED.reset(joining)
                link.joining = None
            link.setup, link.last_error = setup, None
        self._sweep_idle()
        return await self.state(join.model)

    async def _room_for(
        self, link: Link, engine: WeightTransfer, join: Join, idle_since: float
    ) -> Connection:
        """The connection this server joins `join`'s group with, once the group it is in (if
        any) gave way; a refusal (before any rank of this server joined) otherwise."""
        if link.setup is not None:
            reason = await self._replaceable(link.setup, join, idle_since)
            if reason is None:
                setup = link.setup
                raise Conflict(
                    f"already in a weight-transfer group with the trainer at "
                    f"{setup.address}:{setup.port}, which still answers there; it leaves "
                    "it with its own close call, or an admin closes it (POST "
                    "/v1/weights/transfer/close)",
                    role=Role.MODEL,
                )
            logger.warning(
                "closing the weight-transfer group of '%s' (trainer at %s:%d): %s",
                join.model,
                link.setup.address,
                link.setup.port,
                reason,
            )
            await self.leave(link, engine)
        last = join.connection.rank_offset + engine.ranks
        if last > join.connection.world_size:
            raise InvalidInput(
                f"{join.connection.world_size} leaves no room for the server's "
                f"{engine.ranks} rank(s) from rank_offset {join.connection.rank_offset}",
                role=Role.GROUP_SIZE,
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

        self.spawn(stand_ins())

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
                        await self.leave(link, self.engine(model))

    def _transport(self, join: Join) -> Transport:
        device = self.registry.weights(join.model).info.device
        on_gpu = device.startswith("cuda")
        if join.connection.transport == "auto":
            return "nccl" if on_gpu else "gloo"
        if join.connection.transport == "nccl" and not on_gpu:
            raise InvalidInput(
                f"NCCL needs the model on a GPU; '{join.model}' is on {device}",
                role=Role.TRANSPORT,
            )
        return join.connection.transport

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
        async with self.link(model) as (link, engine):
            await self.leave(link, engine)
        return await self.state(model)

    @staticmethod
    async def leave(link: Link, engine: WeightTransfer) -> None:
        """Leave the group: whatever was staged is dropped."""
        link.setup, link.updating, link.announced, link.adapter = None, False, [], None
        await engine.close()

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for task in list(self._tasks):
            task.cancel()
        for model in list(self._links):
            with contextlib.suppress(Exception):
                await self.close(model)

    async def drop(self, link: Link, engine: WeightTransfer, exc: BaseException) -> None:
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
    def joined(link: Link) -> Connection:
        if link.setup is None:
            raise Conflict("not in a weight-transfer group; call init first", role=Role.MODEL)
        return link.setup

    def updating(self, link: Link) -> Connection:
        setup = self.joined(link)
        if not link.updating:
            raise Conflict("no weight update in progress; call start first", role=Role.MODEL)
        return setup
