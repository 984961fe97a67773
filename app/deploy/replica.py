"""One replica's side of the steps `app.deploy.replicated` takes over every replica: each is a
method of `ReplicaEndpoint` taking and answering typed, picklable values, and running this
replica's own local step (`app.updates.local.LocalWeights`). A failure is answered as a
`Refusal`, so it crosses process boundaries with its kind, message and field intact."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from app.common import failures
from app.common.failures import Conflict, Failure, PeerFailed
from app.engine.gate import GateState
from app.updates.local import LocalWeights
from app.updates.types import Announcement, Applied, Join, PauseMode, Publish, TransferStatus
from app.weights.shipment import Shipment

P = ParamSpec("P")
T = TypeVar("T")


@dataclass(frozen=True)
class Refusal:
    """A replica's failure, as data."""

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: Failure) -> Refusal:
        return cls(type(exc).__name__, exc.message, exc.param)

    @classmethod
    def unreachable(cls, exc: BaseException) -> Refusal:
        """A replica that could not answer (gone, or failed outside the domain's failures)."""
        return cls(PeerFailed.__name__, str(exc) or type(exc).__name__)

    def failure(self, context: str) -> Failure:
        """The failure it raised there (same status, same field), `context` appended."""
        kind = getattr(failures, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, Failure)):
            kind = PeerFailed
        return kind(f"{self.message} ({context})", param=self.param)


@dataclass(frozen=True)
class Stage:
    update_id: str
    shipment: Shipment
    model: str
    param: str
    """The request field the checkpoint came from (named in a refusal)."""


@dataclass(frozen=True)
class Commit:
    update_id: str
    model: str
    publish: Publish
    """The version every replica publishes, and the pause."""


@dataclass(frozen=True)
class Committed:
    applied: Applied | None
    """None: this replica started after the others staged the update, and caught up to it."""


@dataclass(frozen=True)
class Ranks:
    replica: str
    ranks: int


def answered(step: Callable[P, Awaitable[T]]) -> Callable[P, Coroutine[Any, Any, T | Refusal]]:
    """A step whose failure is answered as a Refusal."""

    @functools.wraps(step)
    async def answer(*args: P.args, **kwargs: P.kwargs) -> T | Refusal:
        try:
            return await step(*args, **kwargs)
        except Failure as exc:
            return Refusal.of(exc)

    return answer


class ReplicaEndpoint:
    """What the other replicas may ask of this one. The replica supplies `local_weights` and
    `replica_id` (on Ray Serve, the deployment class; in tests, a fake)."""

    def local_weights(self) -> LocalWeights:
        raise NotImplementedError

    def replica_id(self) -> str:
        raise NotImplementedError

    # -- one checkpoint update: stage, then commit or abort ------------------------------

    @answered
    async def weights_stage(self, stage: Stage) -> int:
        """Copy and check the shipped checkpoint; the version this replica serves now."""
        files = self.local_weights().files
        return await files.stage(stage.update_id, stage.shipment, stage.model, stage.param)

    @answered
    async def weights_commit(self, commit: Commit) -> Committed:
        weights = self.local_weights()
        caught_up = weights.registry.versions[commit.model] == commit.publish.version
        if not weights.files.has_staged(commit.update_id) and caught_up:
            return Committed(None)
        return Committed(
            await weights.files.commit_staged(commit.update_id, commit.model, commit.publish)
        )

    async def weights_abort(self, update_id: str) -> None:
        self.local_weights().files.abort_staged(update_id)

    # -- serving ---------------------------------------------------------------------------

    @answered
    async def serving_pause(self, mode: PauseMode) -> GateState:
        return await self.local_weights().pause(mode)

    @answered
    async def serving_resume(self) -> GateState:
        return await self.local_weights().resume()

    # -- the collective transfer -------------------------------------------------------------

    @answered
    async def transfer_state(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_state(model)

    @answered
    async def transfer_ranks(self, model: str) -> Ranks:
        return Ranks(self.replica_id(), self.local_weights().transfers.ranks(model))

    @answered
    async def transfer_join(self, join: Join, offsets: dict[str, int]) -> TransferStatus:
        """Join at this replica's rank offset (`offsets`: by replica id)."""
        if (offset := offsets.get(self.replica_id())) is None:
            raise Conflict(
                "model: the replicas changed while the group formed; init again", param="model"
            )
        return await self.local_weights().transfer_init(join.at(offset))

    @answered
    async def transfer_start(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_start(model)

    @answered
    async def transfer_update(self, announced: Announcement) -> TransferStatus:
        return await self.local_weights().transfer_update(announced)

    @answered
    async def transfer_abort(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_abort(model)

    @answered
    async def transfer_close(self, model: str) -> TransferStatus:
        return await self.local_weights().transfer_close(model)

    @answered
    async def transfer_received(self, model: str) -> int:
        """Every announced tensor arrived and passed its checks; the version served now."""
        return await self.local_weights().transfers.received(model)

    @answered
    async def transfer_commit(self, model: str, publish: Publish) -> Committed:
        weights = self.local_weights()
        state = await weights.transfers.state(model)
        caught_up = weights.registry.versions[model] == publish.version
        if state.state != "updating" and caught_up:
            return Committed(None)  # started after the others received it
        return Committed(await weights.transfers.commit(model, publish))

    @answered
    async def transfer_abandon(self, model: str, reason: Refusal) -> None:
        """Drop the update, which failed on another replica for `reason`."""
        failure = reason.failure("on another replica")
        await self.local_weights().transfers.abandon(model, failure)
