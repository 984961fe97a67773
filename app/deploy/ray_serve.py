"""rlserve on Ray Serve: each replica is a whole rlserve engine (the policy and the reference,
on the replica's own devices) behind Ray Serve's HTTP proxy, which spreads requests over the
replicas; Ray checks their health and restarts the ones that fail, and autoscales between
the bounds given. Sessions and trajectories must then live in a store every replica shares
(`RLSERVE_SESSION_STORE=redis://...`): any replica serves any session.

    rlserve serve --replicas 2 ...                  # a local Ray cluster (or RAY_ADDRESS)
    serve run app.deploy.ray_serve:build replicas=2 # Ray's own CLI; args as key=value
    serve deploy docker/ray-serve.yaml              # a config file (KubeRay: docker/kuberay.yaml)

Settings come from the RLSERVE_* environment of the process that builds the application
(handed to every replica) and from the application's args, whose keys are Settings fields;
`replicas`, `min_replicas`, `max_replicas`, `target_ongoing_requests`,
`max_ongoing_requests`, `num_cpus`, `num_gpus` and `sticky_sessions` shape the deployment
(Ray gives a replica's torch as many threads as its `num_cpus`). Each replica keeps its local
state (uploads, staged checkpoints, engine weight copies) in `data_dir/<replica id>`."""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from app.common.failures import Conflict
from app.config import Settings
from app.deploy.fanout import ReplicaFanout, as_failure, outcome
from app.main import create_app
from app.weights.protocol import (
    TransferFinish,
    TransferInit,
    TransferState,
    TransferUpdate,
    UpdateOptions,
)

DEPLOYMENT = "rlserve"
_SHAPE = (
    "replicas",
    "max_ongoing_requests",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "num_cpus",
    "num_gpus",
    "sticky_sessions",
)
STICKY_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
"""Ray Serve's consistent-hash router: requests that carry the same `x-session-id` header
(the client sends an environment's or a trajectory's id) go to the same replica while it
stands and has room; others spread evenly."""


@serve.ingress()
class RLServeReplica:
    """One replica: the rlserve app, built on the replica (its lifespan loads the models).
    (`app` is the ingress wrapper's own attribute: ours is `server`.)"""

    def __init__(self, overrides: dict[str, Any], generation: str) -> None:
        self.overrides = overrides
        self.generation = generation
        self.server: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        settings = Settings(**{**self.overrides, "replica_id": replica})
        # Local state (uploads, staged checkpoints, engine weight copies) is the replica's own.
        settings = settings.model_copy(update={"data_dir": settings.data_dir / replica})
        fanout = ReplicaFanout(
            context.app_name,
            context.deployment,
            self.generation,
            wait_s=settings.weights_io_timeout_s,
        )
        self.server = create_app(settings, fanout=fanout)
        return self.server

    # -- one weight update over every replica (app.deploy.fanout) -------------------------

    def _weights(self) -> Any:
        assert self.server is not None
        return self.server.state.weights

    async def weights_stage(
        self, update_id: str, files: dict[str, bytes], model: str, param: str
    ) -> dict[str, Any]:
        """`files` arrive through Ray's object store (Serve resolves the reference sent)."""

        async def stage() -> dict[str, Any]:
            return {"version": await self._weights().stage(update_id, files, model, param)}

        return await outcome(stage())

    async def weights_commit(
        self, update_id: str, model: str, options: dict[str, Any]
    ) -> dict[str, Any]:
        async def commit() -> dict[str, Any]:
            chosen = UpdateOptions(**options)
            weights = self._weights()
            if not weights.has_staged(update_id) and weights.registry.versions[model] == (
                chosen.version
            ):
                return {"caught_up": True}  # started after the staging, caught up to it
            updated = await weights.commit_staged(update_id, model, chosen)
            return {"updated": updated.model_dump()}

        return await outcome(commit())

    async def serving_pause(self, mode: str) -> dict[str, Any]:
        async def pause() -> dict[str, Any]:
            state = await self._weights().pause(mode, here_only=True)
            return {"state": dataclasses.asdict(state)}

        return await outcome(pause())

    async def serving_resume(self) -> dict[str, Any]:
        async def resume() -> dict[str, Any]:
            state = await self._weights().resume(here_only=True)
            return {"state": dataclasses.asdict(state)}

        return await outcome(resume())

    async def weights_abort(self, update_id: str) -> dict[str, Any]:
        self._weights().abort_staged(update_id)
        return {"ok": True}

    # -- the collective transfer over every replica (app.deploy.fanout) ---------------------

    def _transfers(self) -> Any:
        assert self.server is not None
        return self.server.state.transfers

    async def transfer_state(self, model: str) -> dict[str, Any]:
        return await _state(self._transfers().state(model, here_only=True))

    async def transfer_ranks(self, model: str) -> dict[str, Any]:
        async def ranks() -> dict[str, Any]:
            return {"replica": self._replica(), "ranks": self._transfers().ranks(model)}

        return await outcome(ranks())

    async def transfer_join(self, body: dict[str, Any], offsets: dict[str, int]) -> dict[str, Any]:
        """Join at this replica's rank offset (`offsets`: by replica id)."""

        async def join() -> TransferState:
            if (offset := offsets.get(self._replica())) is None:
                raise Conflict(
                    "model: the replicas changed while the group formed; init again",
                    param="model",
                )
            request = TransferInit(**{**body, "rank_offset": offset})
            return await self._transfers().init(request, here_only=True)

        return await _state(join())

    async def transfer_step(self, step: str, model: str) -> dict[str, Any]:
        """start, abort or close here."""
        return await _state(getattr(self._transfers(), step)(model, here_only=True))

    async def transfer_update(self, body: dict[str, Any]) -> dict[str, Any]:
        update = TransferUpdate(**body)
        return await _state(self._transfers().update(update, here_only=True))

    async def transfer_received(self, model: str) -> dict[str, Any]:
        async def received() -> dict[str, Any]:
            return {"version": await self._transfers().received(model)}

        return await outcome(received())

    async def transfer_commit(self, body: dict[str, Any]) -> dict[str, Any]:
        async def commit() -> dict[str, Any]:
            request = TransferFinish(**body)
            transfers = self._transfers()
            state = await transfers.state(request.model, here_only=True)
            versions = self._weights().registry.versions
            if state.state != "updating" and versions[request.model] == request.version:
                return {"caught_up": True}  # started after the others received it
            return {"updated": (await transfers.commit(request)).model_dump()}

        return await outcome(commit())

    async def transfer_abandon(self, model: str, reason: dict[str, Any]) -> dict[str, Any]:
        async def abandon() -> dict[str, Any]:
            failure = as_failure({"error": reason}, "on another replica")
            await self._transfers().abandon(model, failure)
            return {}

        return await outcome(abandon())

    def _replica(self) -> str:
        return str(serve.get_replica_context().replica_id.unique_id)

    async def check_health(self) -> None:
        """Ray's health check: raise while the engine is not ready or does not answer (Ray
        restarts a replica that keeps failing it)."""
        if self.server is None:
            return
        problem = await self.server.state.probe.problem()
        if problem is not None and self.server.state.registry.status != "loading":
            raise RuntimeError(problem)


async def _state(work: Awaitable[TransferState]) -> dict[str, Any]:
    """A replica's transfer state after `work`, or its failure, as data."""

    async def state() -> dict[str, Any]:
        return {"state": (await work).model_dump()}

    return await outcome(state())


def build(args: dict[str, Any]) -> Application:
    """The application `serve run` / `serve deploy` import (an application builder)."""
    overrides = {k: v for k, v in args.items() if k not in _SHAPE}
    settings = Settings(**overrides)  # fail here, before any replica starts, on a bad arg
    most = int(args.get("max_replicas", args.get("replicas", 1)))
    if settings.session_store is None and most > 1:
        raise ValueError(
            "several replicas need a shared session store: set session_store (or "
            "RLSERVE_SESSION_STORE) to a redis:// URL"
        )
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        # The engine batches concurrent requests itself: Ray Serve must not hold them back
        # (its default of 5 in flight per replica would starve the batcher).
        "max_ongoing_requests": int(args.get("max_ongoing_requests", 1024)),
        "health_check_period_s": 10,
        "health_check_timeout_s": settings.ready_probe_timeout_s + 5,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
        "ray_actor_options": {
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
            # Replicas read the same RLSERVE_* settings as the process that deploys them.
            "runtime_env": {
                "env_vars": {k: v for k, v in os.environ.items() if k.startswith("RLSERVE_")}
            },
        },
    }
    if str(args.get("sticky_sessions", "")).lower() in ("1", "true", "yes"):
        # Sticky where it helps (the replica's prefix cache holds the episode so far);
        # correctness never depends on it: any replica serves any session.
        options["request_router_config"] = {
            "request_router_class": STICKY_ROUTER,
            "request_router_kwargs": {"num_fallback_replicas": 2},
        }
    if "min_replicas" in args or "max_replicas" in args:
        options["autoscaling_config"] = {
            "min_replicas": int(args.get("min_replicas", 1)),
            "max_replicas": int(args.get("max_replicas", args.get("min_replicas", 1))),
            "target_ongoing_requests": int(args.get("target_ongoing_requests", 16)),
        }
    else:
        options["num_replicas"] = int(args.get("replicas", 1))
    deployment = serve.deployment(**options)(RLServeReplica)
    # Each deploy is a generation with its own ledger (app.deploy.ledger): it starts from the
    # base weights, as a restarted server does.
    return deployment.bind(overrides, uuid.uuid4().hex)
