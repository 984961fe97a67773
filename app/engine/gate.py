"""Who may use the models now, and the versions of their weights.

Every model request is admitted through the gate as scoring or generation work. A pause closes
the gate (new requests wait, nothing is refused) and then handles the work already inside:

- ``wait``: lets it all finish;
- ``abort``: ends in-flight generations at their next token (they return what they produced,
  with finish_reason "abort") and lets scoring finish; what a generation scores after its
  tokens (`unless_aborted`) is cancelled, and its rows end "abort" as well;
- ``keep``: lets scoring finish and freezes in-flight generations at their next token; they
  continue after the resume, on whatever weights are then served.

A weight update runs inside `updating`: it pauses (``keep`` by default, so no request is lost or
redone), yields the version it will publish, and the version is set only if the commit returns.
The gate owns the versions and serializes pauses, resumes and updates, so two updates can never
report each other's version."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from app.common.failures import Conflict
from app.engine.abandon import unless_set
from app.engine.base import Backend

PauseMode = Literal["wait", "abort", "keep"]
WorkKind = Literal["score", "generate"]
R = TypeVar("R")


@dataclass(frozen=True)
class GateState:
    paused: bool
    mode: PauseMode | None
    paused_by: Literal["request", "update"] | None
    in_flight_generations: int
    in_flight_scoring: int
    waiting: int


class ServingGate:
    def __init__(self, backends: Callable[[], Mapping[str, Backend]]) -> None:
        self.versions = {"policy": 0, "reference": 0}
        self._backends = backends
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Condition()
        self._in_flight: dict[WorkKind, int] = {"score": 0, "generate": 0}
        self._waiting = 0
        self._control = asyncio.Lock()
        self._mode: PauseMode | None = None
        self._by: Literal["request", "update"] | None = None
        self._aborting = asyncio.Event()  # set while an abort pause holds

    # -- requests ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self, kind: WorkKind) -> AsyncIterator[int]:
        """Hold a place for one request's model work; yields the policy version it starts on.
        Scoring never spans an update; a generation may (its tokens carry their versions)."""
        while not self._open.is_set():
            self._waiting += 1
            try:
                await self._open.wait()
            finally:
                self._waiting -= 1
        self._in_flight[kind] += 1
        try:
            yield self.versions["policy"]
        finally:
            self._in_flight[kind] -= 1
            async with self._changed:
                self._changed.notify_all()

    async def unless_aborted(self, work: Awaitable[R]) -> R | None:
        """`work`, model work a generation does after its tokens (inside its `admitted`), or
        None when an abort pause begins first. The pause waits for generations to leave, and
        an engine it paused starts no new request before the resume: the work is cancelled
        instead of waited for."""
        return await unless_set(work, self._aborting)

    def state(self) -> GateState:
        return GateState(
            paused=self._mode is not None,
            mode=self._mode,
            paused_by=self._by,
            in_flight_generations=self._in_flight["generate"],
            in_flight_scoring=self._in_flight["score"],
            waiting=self._waiting,
        )

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> GateState:
        """Pause on request; returns once in-flight work is finished, aborted or frozen."""
        async with self._control:
            if self._mode is not None:
                if self._mode == mode:
                    return self.state()
                raise Conflict(
                    f"mode: serving is already paused with mode '{self._mode}'; resume first",
                    param="mode",
                )
            await self._pause(mode, "request")
            return self.state()

    async def resume(self) -> GateState:
        async with self._control:
            if self._mode is not None:
                await self._resume()
            return self.state()

    async def _pause(self, mode: PauseMode, by: Literal["request", "update"]) -> None:
        self._open.clear()
        self._mode, self._by = mode, by
        try:
            await self._drained("score")
            if mode == "wait":
                await self._drained("generate")
            elif mode == "abort":
                self._aborting.set()
                for backend in self._backends().values():
                    await backend.abort_generations()
                await self._drained("generate")
            for backend in self._backends().values():
                await backend.freeze()
        except BaseException:
            await self._resume()
            raise

    async def _resume(self) -> None:
        for backend in self._backends().values():
            await backend.thaw()
        self._mode = self._by = None
        self._aborting.clear()
        self._open.set()

    async def _drained(self, kind: WorkKind) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._in_flight[kind] == 0)

    # -- updates ---------------------------------------------------------------------------

    def next_version(self, name: str, requested: int | None) -> int:
        """The version an update of `name` publishes: `requested`, which must be above the
        current one (Conflict otherwise), or the current one plus one."""
        current = self.versions[name]
        if requested is None:
            return current + 1
        if requested <= current:
            raise Conflict(
                f"version: {requested} is not above the current version {current} of '{name}'",
                param="version",
            )
        return requested

    @contextlib.asynccontextmanager
    async def updating(
        self, name: str, *, mode: PauseMode = "keep", version: int | None = None
    ) -> AsyncIterator[int]:
        """Serving paused (unless a request paused it already, which then stays paused);
        yields the version to publish, set only when the block returns."""
        async with self._control:
            new = self.next_version(name, version)
            paused_here = self._mode is None
            if paused_here:
                await self._pause(mode, "update")
            try:
                yield new
                self.versions[name] = new
                await self._backends()[name].set_version(new)
            finally:
                if paused_here:
                    await self._resume()
