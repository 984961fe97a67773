"""Replicas of one deployment in this process, for the tests of `app.deploy.replicated`: each
a real `LocalWeights`, reached through a fake handle that pickles what crosses (as Ray would)
and can make a replica fail a step."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from app.deploy.ledger import LocalLedger
from app.deploy.replica import Refusal, ReplicaEndpoint
from app.updates.local import LocalWeights
from app.weights.shipment import Held


class InProcessReplica(ReplicaEndpoint):
    def __init__(self, name: str, weights: LocalWeights) -> None:
        self.name, self.weights = name, weights

    def local_weights(self) -> LocalWeights:
        return self.weights

    def replica_id(self) -> str:
        return self.name


class FakeReplicas:
    """Every replica, reached as over a wire: arguments and answers are pickled both ways,
    a replica told to fail a step answers as one that could not be reached, and each step is
    logged with its update's id (when it has one)."""

    def __init__(self, replicas: Sequence[InProcessReplica], ledger: LocalLedger) -> None:
        self.replicas = replicas
        self.ledger = ledger
        self.unreachable: dict[tuple[str, str], str] = {}  # (replica, step): why
        self.log: list[tuple[str, str | None]] = []
        self.chunks: list[int] = []

    async def each(
        self, step: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> list[Any]:
        update_id = getattr(args[0], "update_id", None) if args else None
        self.log.append((step.__name__, update_id))

        async def one(replica: InProcessReplica) -> Any:
            if (why := self.unreachable.get((replica.name, step.__name__))) is not None:
                return Refusal.unreachable(ConnectionError(why))
            sent_args, sent_kwargs = pickle.loads(pickle.dumps((args, kwargs)))
            try:
                answer = await step(replica, *sent_args, **sent_kwargs)
            except Exception as exc:
                return Refusal.unreachable(exc)
            return pickle.loads(pickle.dumps(answer))

        return list(await asyncio.gather(*(one(r) for r in self.replicas)))

    def put(self, data: bytes) -> Held:
        self.chunks.append(len(data))
        return Held(data)
