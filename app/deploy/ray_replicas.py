"""Every replica of a Ray Serve deployment, for `app.deploy.replicated`: a step runs on each
through Ray Serve's own fan-out (`DeploymentHandle.broadcast`, by the step's method name on
`ReplicaEndpoint`, which the deployment class inherits); chunks travel as Ray objects; the
ledger is the deployment generation's actor."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from ray import serve

from app.deploy.ray_ledger import RayChunk, RayLedger, put
from app.deploy.replica import Refusal, ReplicaEndpoint

P = ParamSpec("P")
T = TypeVar("T")


class RayReplicas:
    def __init__(self, app_name: str, deployment: str, generation: str) -> None:
        self.app_name = app_name
        self.deployment = deployment
        self.ledger = RayLedger(app_name, generation)

    async def each(
        self,
        step: Callable[Concatenate[ReplicaEndpoint, P], Awaitable[T]],
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> list[T | Refusal]:
        handle: Any = serve.get_deployment_handle(self.deployment, self.app_name)
        response = handle.broadcast(step.__name__, *args, **kwargs)
        results = await response.results_async(return_exceptions=True)
        return [
            Refusal.unreachable(r) if isinstance(r, BaseException) else cast(T | Refusal, r)
            for r in results
        ]

    def put(self, data: bytes) -> RayChunk:
        return put(data)
