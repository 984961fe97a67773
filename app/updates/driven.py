"""The weight update a trainer drives over several calls (SGLang's and AReaL's routes), run on
the session record `WeightsControl` keeps (`app.updates.session`): each change is one named
transition, a function of the record read, written by compare-and-set, so a call may reach
any replica of a deployment.

When the update becomes visible follows the flow the trainer drives:
- inside a begin … end: at the end;
- while serving is paused (what slime and AReaL do around their buckets): at the resume,
  before generation resumes;
- otherwise each bucket is an update of its own."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

from app.common.failures import Conflict
from app.engine.registry import ModelRegistry
from app.updates.control import WeightsControl, abort_in_flight
from app.updates.session import Bucket, UpdateSession
from app.updates.types import Announcement, Applied, Publish

# -- the transitions: each the record a call writes, of the record it read ---------------

OPEN = "a weight-update session is already open; end it first"
SWAP_ATTEMPTS = 8


def begun(session: UpdateSession) -> UpdateSession:
    """A begin: an explicit session opens (refused while one is open)."""
    if session.kind == "explicit":
        raise Conflict(OPEN)
    return UpdateSession("explicit", announced=session.announced)


def ended(session: UpdateSession) -> UpdateSession:
    """An end: the explicit session closes (refused when none is open)."""
    if session.kind != "explicit":
        raise Conflict("no weight-update session is open; begin one first")
    return closed(session)


def closed(session: UpdateSession) -> UpdateSession:
    """`session` committed: none open, what was announced kept."""
    return replace(session, kind=None, version=None)


def resumed(session: UpdateSession) -> UpdateSession:
    """Serving resumes: a session of buckets sent while paused closes; nothing else changes."""
    return closed(session) if session.kind == "paused" else session


def held(session: UpdateSession, paused: bool) -> UpdateSession:
    """A bucket arrives: while serving is paused, with no session open, it opens one."""
    if session.kind is None and paused:
        return UpdateSession("paused", announced=session.announced)
    return session


def named(session: UpdateSession, opened: int | None, version: int) -> UpdateSession:
    """A bucket of the session opened at `opened` names the version the session publishes
    (refused when another call committed that session meanwhile)."""
    if session.kind is None or session.opened != opened:
        raise Conflict(
            "the weight-update session this bucket was sent in was committed by another "
            "call before the bucket's version was recorded"
        )
    return replace(session, version=version)


def announced(session: UpdateSession, bucket: Bucket) -> UpdateSession:
    """Tensors named for the next receive (AReaL's meta call)."""
    return replace(session, announced=bucket)


def taken(session: UpdateSession) -> UpdateSession:
    """The announced tensors taken for a receive (refused when none were announced)."""
    if session.announced is None:
        raise Conflict("no tensors were announced; set the update's meta first")
    return replace(session, announced=None)


# -- the flow --------------------------------------------------------------------------


class DrivenUpdates:
    """The trainer-driven update flow of the policy's weights over `WeightsControl` (SGLang's
    and AReaL's routes take it). Every change to the session is one compare-and-set
    (`_write`), made before the transfer step it stands for: of two begins one opens the
    session, of two ends one commits it, and a bucket never reopens a session another call
    committed. Calls to one server also run one at a time, so a bucket's steps are not
    interleaved with another's there."""

    def __init__(self, registry: ModelRegistry, weights: WeightsControl) -> None:
        self.registry = registry
        self.weights = weights
        self._lock = asyncio.Lock()

    async def _write(
        self, change: Callable[[UpdateSession], UpdateSession]
    ) -> tuple[UpdateSession, UpdateSession]:
        """The session read and the one written: `change` of the record as the control holds
        it, written unless another call wrote first (then `change` again, of what that call
        wrote). `change` raises to refuse, and returns what it read to leave it be."""
        for _ in range(SWAP_ATTEMPTS):
            read = await self.weights.session()
            new = change(read)
            if new is read:
                return read, read
            if (written := await self.weights.swap_session(read.serial, new)) is not None:
                return read, written
        raise Conflict("the weight-update session kept changing under other calls; retry")

    async def _start(self, opened: UpdateSession) -> None:
        """Start the transfer of a session this call opened; if it cannot, close it again."""
        try:
            await self.weights.transfer_start("policy")
        except BaseException:
            await self.weights.swap_session(opened.serial, closed(opened))
            raise

    async def begin(self) -> None:
        async with self._lock:
            read, written = await self._write(begun)
            if read.kind is None:
                await self._start(written)

    async def end(self) -> Applied:
        async with self._lock:
            read, _ = await self._write(ended)
            return await self._publish(read)

    async def resume(self) -> None:
        """Commit the buckets received while paused, then resume: serving resumes whether the
        commit succeeds or is refused (the refusal is then answered), never left paused."""
        async with self._lock:
            try:
                read, written = await self._write(resumed)
                if written is not read:
                    await self._publish(read)
            finally:
                await self.weights.resume()

    async def receive(self, bucket: Bucket) -> Applied | None:
        """Stage one bucket; commit it too when no session holds it (then the new state)."""
        announce = Announcement(
            model="policy",
            names=list(bucket.names),
            dtype_names=list(bucket.dtypes),
            shapes=[list(shape) for shape in bucket.shapes],
            buckets=[len(bucket.names)] if bucket.flattened else None,
        )
        async with self._lock:
            gate = self.registry.gate
            if bucket.abort_all and not gate.state().paused:
                await abort_in_flight(self.registry, self.weights)
            # (the pause is read again on each try: a write that came first may follow one)
            read, session = await self._write(lambda s: held(s, gate.state().paused))
            if session.kind is None:  # an update of its own
                await self.weights.transfer_start("policy")
                await self.weights.transfer_update(announce)
                return await self.weights.transfer_finish(
                    "policy", Publish(version=bucket.version, restartable=True)
                )
            if read.kind is None:
                await self._start(session)
            await self.weights.transfer_update(announce)
            if bucket.version is not None:
                version = bucket.version
                await self._write(lambda now: named(now, session.opened, version))
            return None

    async def announce(self, bucket: Bucket) -> None:
        """Remember the tensors of the next `receive_announced` (AReaL's vLLM server takes
        them in a call of their own, before the one that receives them)."""
        async with self._lock:
            await self._write(lambda session: announced(session, bucket))

    async def receive_announced(self) -> Applied | None:
        """`receive` of the tensors `announce` named (409 when none were)."""
        async with self._lock:
            read, _ = await self._write(taken)
        assert read.announced is not None
        return await self.receive(read.announced)

    async def _publish(self, session: UpdateSession) -> Applied:
        """Commit what `session` received (this call closed it)."""
        return await self.weights.transfer_finish(
            "policy", Publish(version=session.version, restartable=True)
        )
