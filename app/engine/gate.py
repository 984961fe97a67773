"""Who may use the models now, and the versions of their weights.

Every model request is admitted through the gate as scoring or generation work. A pause closes
the gate (new requests wait for the resume) and then handles the work already inside:

- ``wait``: lets it all finish;
- ``abort``: ends in-flight generations at their next token (they return what they produced,
  with finish_reason "abort") and lets scoring finish; what a generation scores after its
  tokens (`unless_aborted`) is cancelled, and its rows end "abort" as well;
- ``keep``: lets scoring finish and freezes in-flight generations at their next token; they
  continue after the resume, on whatever weights are then served.

A request never waits for a pause without end: past `paused_wait_s` it is refused (a retryable
`Paused`, 503 with Retry-After), having started nothing.

A weight update runs inside `updating`: it pauses (``keep`` by default, so no request is lost or
redone), yields the version it will publish, and the version is set only if the commit returns.
The gate owns the versions and serializes pauses, resumes and updates, so two updates can never
report each other's version.

Versions only go up, so the versions of a generation's tokens are ordered. A trainer that
restarts from a checkpoint counts its versions again from below the served one: an update that
allows it (`restartable`, as the dialects' updates do) is then served as the next version and
opens a new lineage (`Lineage`: the operator sees it in /ready and /metrics), whose later
versions are the trainer's count shifted by as much, instead of being refused. The dialects'
routes, whose trainers number the versions, give each version in its lineage's count
(`label`), as SGLang and vLLM give back the version a trainer named."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from app.common.failures import Conflict, Paused, VersionBehind, VersionPassed, invalid
from app.common.roles import Role
from app.engine import pins
from app.engine.abandon import unless_set
from app.engine.base import ModelWeights
from app.engine.types import MAX_VERSION

PauseMode = Literal["wait", "abort", "keep"]
WorkKind = Literal["score", "generate"]
R = TypeVar("R")
T = TypeVar("T")
logger = logging.getLogger(__name__)


async def wait_for_resume(opened: asyncio.Event, wait_s: float | None, what: str) -> None:
    """Wait until `opened` is set again, at most `wait_s` seconds (None: without end); then
    a `Paused` refusal saying that `what` is still paused."""
    try:
        async with asyncio.timeout(wait_s):
            await opened.wait()
    except TimeoutError:
        raise Paused(
            f"{what} has been paused for over {wait_s:g} s (the longest a request waits for a "
            "resume: RLSERVE_LIMITS__PAUSED_WAIT_S); nothing was started, send it again later"
        ) from None


class Admission(Generic[T]):
    """The admission both gates share (serving's, `ServingGate`, and each adapter's,
    `app.engine.adapter_gate`): requests wait while it is paused (at most `paused_wait_s`,
    then a `Paused` refusal saying that `what` is still paused), and each one admitted is
    counted inside, with a tag, until it leaves; a pause waits for those its mode waits for."""

    def __init__(self, what: str, *, paused_wait_s: float | None = None) -> None:
        """`paused_wait_s`: how long a request may wait for the resume (None: no limit)."""
        self.what = what
        self.paused_wait_s = paused_wait_s
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Condition()
        self._control = asyncio.Lock()
        """Held by a pause, a resume or an update: they never interleave."""
        self._mode: PauseMode | None = None
        self._inside: dict[object, T] = {}
        self._waiting = 0

    @contextlib.asynccontextmanager
    async def _entered(self, tag: T) -> AsyncIterator[None]:
        """Wait while paused; then hold a place inside, tagged `tag`, for the block."""
        while not self._open.is_set():
            self._waiting += 1
            try:
                await wait_for_resume(self._open, self.paused_wait_s, self.what)
            finally:
                self._waiting -= 1
        place = object()
        self._inside[place] = tag
        try:
            yield
        finally:
            del self._inside[place]
            async with self._changed:
                self._changed.notify_all()

    def _inside_with(self, tagged: Callable[[T], bool]) -> list[T]:
        return [tag for tag in self._inside.values() if tagged(tag)]

    def _already(self, mode: PauseMode) -> bool:
        """Whether a pause with `mode` holds already (a pause with another mode: Conflict)."""
        if self._mode is None:
            return False
        if self._mode == mode:
            return True
        raise Conflict(
            f"{self.what} is already paused with mode '{self._mode}'; resume it first",
            role=Role.PAUSE_MODE,
        )

    def _close(self, mode: PauseMode) -> None:
        self._open.clear()
        self._mode = mode

    def _reopen(self) -> None:
        self._mode = None
        self._open.set()

    async def _drained(self, tagged: Callable[[T], bool] = lambda _: True) -> None:
        """Until no request inside has a tag `tagged` picks."""
        async with self._changed:
            await self._changed.wait_for(lambda: not self._inside_with(tagged))


@dataclass(frozen=True)
class Lineage:
    """A run of versions numbered by one trainer. The first is lineage 0, from the start; a
    trainer that counts again from below the served version (restarted from a checkpoint)
    opens the next."""

    number: int = 0
    since: int = 0
    """The first version served in it."""
    named: int | None = None
    """The version its trainer named for that first update (None: the server's own count)."""

    @property
    def offset(self) -> int:
        """What the trainer's count is shifted by: its version k is served as k + offset."""
        return 0 if self.named is None else self.since - self.named


@dataclass(frozen=True)
class Commit:
    """How an update is published at the gate: the pause it holds (`mode`, unless a request
    paused serving already), the version it asks for (`version`; None: the next), whether
    that is the trainer's count (`restartable`, see `resolve`), the lineage a deployment's
    coordinator opened for it (`lineage_named`: the trainer's count at `version`), and
    whether the engine keeps its prefix cache across the change (`keep_cache`); and the
    identity of the published snapshot it serves (`snapshot`; None: none, whatever was
    served before: `ModelRegistry.writing` records it)."""

    mode: PauseMode = "keep"
    version: int | None = None
    restartable: bool = False
    lineage_named: int | None = None
    keep_cache: bool = False
    snapshot: str | None = None


@dataclass(frozen=True)
class GateState:
    paused: bool
    mode: PauseMode | None
    paused_by: Literal["request", "update"] | None
    in_flight_generations: int
    in_flight_scoring: int
    waiting: int


def resolve_version(
    name: str, current: int, lineage: Lineage, requested: int | None, *, restartable: bool
) -> tuple[int, int | None]:
    """The version an update of `name` (serving `current`, in `lineage`) publishes, and the
    trainer's version when the update opens a new lineage (else None).

    None: the current version plus one. A version of rlserve's own count must be above the
    current one (else Conflict). A `restartable` one is the trainer's count: shifted by where
    its lineage began, it must be above the current version too; if it is not, the trainer
    counts again (it restarted), and a new lineage begins at the next version."""
    if requested is None:
        return current + 1, None
    if restartable:
        shifted = requested + lineage.offset
        if shifted > MAX_VERSION:
            raise invalid(
                Role.VERSION,
                f"{requested} is the trainer's count, served as {shifted} (its lineage began "
                f"at {lineage.offset + 1}): over the largest version, {MAX_VERSION}",
            )
        if shifted > current:
            return shifted, None
        return current + 1, requested
    if requested <= current:
        raise Conflict(
            f"{requested} is not above the current version {current} of '{name}'",
            role=Role.VERSION,
        )
    return requested, None


class ServingGate(Admission[WorkKind]):
    def __init__(
        self,
        backends: Callable[[], Mapping[str, ModelWeights]],
        *,
        paused_wait_s: float | None = None,
        version_wait_s: float = 0.0,
    ) -> None:
        """`paused_wait_s`: how long a request may wait for a paused gate (None: no limit)."""
        super().__init__("serving", paused_wait_s=paused_wait_s)
        self.versions = {"policy": 0, "reference": 0}
        self._lineages: dict[str, list[Lineage]] = {name: [Lineage()] for name in self.versions}
        """Each model's lineages, in order (the last is the current one)."""
        self._backends = backends
        self._by: Literal["request", "update"] | None = None
        self._aborting = asyncio.Event()  # set while an abort pause holds
        self._version_changed = asyncio.Condition()
        self.version_wait_s = version_wait_s
        """How long a request pinned to a later version waits for it."""

    # -- requests ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def admitted(self, kind: WorkKind) -> AsyncIterator[int]:
        """Hold a place for one request's model work; yields the policy version it starts on.
        Scoring never spans an update; a generation may (its tokens carry their versions). A
        request that pins the version (`app.engine.pins`) is admitted only at a version that
        fits: it waits for one at most `version_wait_s`, then is refused (retryable)."""
        noted = pins.REQUEST.get()
        if noted is not None:
            await self._pinned(noted.pin)
        async with self._entered(kind):
            version = self.versions["policy"]
            if noted is not None:
                self._check_pin(noted.pin, version)
                if noted.admitted is None:
                    noted.admitted = version
            yield version

    async def _pinned(self, pin: pins.Pin) -> None:
        """Until the served version fits `pin`, at most `version_wait_s`."""
        async with self._version_changed:
            try:
                async with asyncio.timeout(self.version_wait_s):
                    await self._version_changed.wait_for(
                        lambda: not pin.waits_for(self.versions["policy"])
                    )
            except TimeoutError:
                pass
        self._check_pin(pin, self.versions["policy"])

    def _check_pin(self, pin: pins.Pin, served: int) -> None:
        if pin.passed(served):
            raise VersionPassed(
                f"version {pin.exact} of the policy is no longer served (version {served} is); "
                "a request pinned to it cannot be answered",
                role=Role.PIN_EXACT,
            )
        if pin.waits_for(served):
            role = Role.PIN_EXACT if pin.exact is not None else Role.PIN_MINIMUM
            wanted = pin.exact if pin.exact is not None else pin.minimum
            raise VersionBehind(
                f"version {served} of the policy is served, below {wanted}; another replica, "
                "or this one after its next update, may serve it: send it again",
                role=role,
            )

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
            in_flight_generations=len(self._inside_with(lambda kind: kind == "generate")),
            in_flight_scoring=len(self._inside_with(lambda kind: kind == "score")),
            waiting=self._waiting,
        )

    # -- pause and resume ------------------------------------------------------------------

    async def pause(self, mode: PauseMode) -> GateState:
        """Pause on request; returns once in-flight work is finished, aborted or frozen."""
        async with self._control:
            if not self._already(mode):
                await self._pause(mode, "request")
            return self.state()

    async def resume(self) -> GateState:
        async with self._control:
            if self._mode is not None:
                await self._resume()
            return self.state()

    async def _pause(self, mode: PauseMode, by: Literal["request", "update"]) -> None:
        self._close(mode)
        self._by = by
        try:
            await self._drained(lambda kind: kind == "score")
            if mode == "wait":
                await self._drained()
            elif mode == "abort":
                self._aborting.set()
                for backend in self._backends().values():
                    await backend.abort_generations()
                await self._drained()
            for backend in self._backends().values():
                await backend.freeze()
        except BaseException:
            await self._resume()
            raise

    async def _resume(self) -> None:
        for backend in self._backends().values():
            await backend.thaw()
        self._by = None
        self._aborting.clear()
        self._reopen()

    # -- updates ---------------------------------------------------------------------------

    def next_version(self, name: str, requested: int | None, *, restartable: bool = False) -> int:
        """The version an update of `name` publishes (see `resolve`)."""
        return self.resolve(name, requested, restartable=restartable)[0]

    def resolve(
        self, name: str, requested: int | None, *, restartable: bool = False
    ) -> tuple[int, int | None]:
        """The version an update of `name` publishes, and the trainer's version when the
        update opens a new lineage (see `resolve_version`)."""
        return resolve_version(
            name, self.versions[name], self.lineage(name), requested, restartable=restartable
        )

    def serve(self, name: str) -> None:
        """Count model `name`'s versions from 0 (a model besides the policy and the reference,
        such as the judge model: its weights never change)."""
        if name not in self.versions:
            self.versions[name] = 0
            self._lineages[name] = [Lineage()]

    def lineage(self, name: str) -> Lineage:
        """`name`'s current lineage."""
        return self._lineages[name][-1]

    @contextlib.asynccontextmanager
    async def updating(self, name: str, commit: Commit) -> AsyncIterator[int]:
        """Serving paused (unless a request paused it already, which then stays paused);
        yields the version to publish (`commit`), set only when the block returns."""
        async with self._control:
            lineage_named = commit.lineage_named
            if lineage_named is None:
                new, lineage_named = self.resolve(
                    name, commit.version, restartable=commit.restartable
                )
            else:
                new = self.next_version(name, commit.version)
            paused_here = self._mode is None
            if paused_here:
                await self._pause(commit.mode, "update")
            try:
                yield new
                self.versions[name] = new
                if lineage_named is not None:
                    self._open_lineage(name, new, lineage_named)
                await self._backends()[name].set_version(new, keep_cache=commit.keep_cache)
                async with self._version_changed:
                    self._version_changed.notify_all()
            finally:
                if paused_here:
                    await self._resume()

    def label(self, name: str, version: int) -> int:
        """`version` of `name` in its trainer's count: less the offset of the lineage it was
        served in (the version itself in lineage 0)."""
        lineage = next(x for x in reversed(self._lineages[name]) if x.since <= version)
        return version - lineage.offset

    def unlabel(self, name: str, count: int) -> int:
        """The version of `name` its trainer counts as `count`, in the current lineage."""
        return count + self.lineage(name).offset

    def _open_lineage(self, name: str, version: int, named: int) -> None:
        lineage = Lineage(self.lineage(name).number + 1, version, named)
        self._lineages[name].append(lineage)
        logger.warning(
            "%s: the trainer counts its versions from %d again (below the served version): "
            "lineage %d begins, served as version %d",
            name,
            named,
            lineage.number,
            version,
        )
