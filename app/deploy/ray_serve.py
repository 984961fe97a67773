"""rlserve on Ray Serve: each replica is a whole rlserve engine (the policy and the reference,
on the replica's own devices) behind Ray Serve's HTTP proxy, which spreads requests over the
replicas; Ray checks their health and restarts the ones that fail, and autoscales between
the bounds given. Sessions and trajectories must then live in a store every replica shares
(`RLSERVE_STORAGE__SESSION_STORE=redis://...`): any replica serves any session.

    rlserve serve --replicas 2 ...                  # a local Ray cluster (or RAY_ADDRESS)
    serve run app.deploy.ray_serve:build replicas=2 # Ray's own CLI; args as key=value
    serve deploy docker/ray-serve.yaml              # a config file (KubeRay: docker/kuberay.yaml)

Settings come from the RLSERVE_* environment of the process that builds the application
(handed to every replica) and from the application's args, whose keys are settings fields
as `group.field` (`storage.session_store=redis://...`; in a config file also nested maps);
`replicas`, `min_replicas`, `max_replicas`, `target_ongoing_requests`,
`max_ongoing_requests`, `num_cpus`, `num_gpus`, `sticky_sessions` and `affinity_threshold`
shape the deployment (Ray gives a replica's torch as many threads as its `num_cpus`), and
`proxy_host` is the proxy's address when the caller knows it (`rlserve serve --replicas`):
without API keys a deployment starts only on loopback, or with `auth.allow_no_keys`. Each
replica keeps its local state (uploads, staged checkpoints, engine weight copies) in
`storage.data_dir/<replica id>`."""

from __future__ import annotations

import os
import uuid
from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from app.config import Settings, nest
from app.deploy.affinity import DEFAULT_LOAD_THRESHOLD
from app.deploy.ray_replicas import RayReplicas
from app.deploy.replica import ReplicaEndpoint
from app.deploy.replicated import ReplicatedWeights
from app.main import create_app
from app.ops.auth import check_exposure
from app.updates.local import LocalWeights

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
    "affinity_threshold",
    "proxy_host",
)
STICKY_ROUTER = "app.deploy.affinity.LoadGatedAffinity"
"""Ray Serve's consistent-hash router, gated by load: requests that carry the same
`x-session-id` header (the client sends an environment's or a trajectory's id) go to the
same replica while it stands and has fewer than `affinity_threshold` requests in flight;
others spread evenly (app.deploy.affinity)."""


@serve.ingress()
class RLServeReplica(ReplicaEndpoint):
    """One replica: the rlserve app, built on the replica (its lifespan loads the models),
    and its side of every update over all replicas (`ReplicaEndpoint`'s methods, which the
    other replicas call through Ray Serve). (`app` is the ingress wrapper's own attribute:
    ours is `server`.)"""

    def __init__(self, overrides: dict[str, Any], generation: str) -> None:
        self.overrides = overrides
        self.generation = generation
        self.server: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        context = serve.get_replica_context()
        replica = context.replica_id.unique_id
        settings = Settings(**self.overrides)
        # Local state (uploads, staged checkpoints, engine weight copies) is the replica's own.
        data_dir = settings.storage.data_dir / replica
        settings = settings.replace(storage={"replica_id": replica, "data_dir": data_dir})
        replicas = RayReplicas(context.app_name, context.deployment, self.generation)
        self.server = create_app(settings, replicas=replicas)
        return self.server

    def local_weights(self) -> LocalWeights:
        assert self.server is not None
        weights: ReplicatedWeights = self.server.state.weights
        return weights.local

    def replica_id(self) -> str:
        return str(serve.get_replica_context().replica_id.unique_id)

    async def check_health(self) -> None:
        """Ray's health check: raise while the engine is not ready or does not answer (Ray
        restarts a replica that keeps failing it)."""
        if self.server is None:
            return
        problem = await self.server.state.probe.problem()
        if problem is not None and self.server.state.registry.status != "loading":
            raise RuntimeError(problem)
        if self.server.state.registry.status == "ready":
            weights: ReplicatedWeights = self.server.state.weights
            if (lag := await weights.lagging()) is not None:
                raise RuntimeError(lag)


def build(args: dict[str, Any]) -> Application:
    """The application `serve run` / `serve deploy` import (an application builder)."""
    overrides = nest({k: v for k, v in args.items() if k not in _SHAPE})
    settings = Settings(**overrides)  # fail here, before any replica starts, on a bad arg
    # `rlserve serve --replicas` names the proxy's address; a config file's http_options
    # are out of sight here (None), so keys, or auth.allow_no_keys, are needed.
    check_exposure(settings.auth, args.get("proxy_host"))
    most = int(args.get("max_replicas", args.get("replicas", 1)))
    if settings.storage.session_store is None and most > 1:
        raise ValueError(
            "several replicas need a shared session store: set storage.session_store (or "
            "RLSERVE_STORAGE__SESSION_STORE) to a redis:// URL"
        )
    options: dict[str, Any] = {
        "name": DEPLOYMENT,
        # The engine batches concurrent requests itself: Ray Serve must not hold them back
        # (its default of 5 in flight per replica would starve the batcher).
        "max_ongoing_requests": int(args.get("max_ongoing_requests", 1024)),
        "health_check_period_s": 10,
        "health_check_timeout_s": settings.probe.timeout_s + 5,
        "graceful_shutdown_timeout_s": settings.http.shutdown_timeout_s,
        "ray_actor_options": {
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
            # Replicas read the same RLSERVE_* settings as the process that deploys them.
            "runtime_env": {
                "env_vars": {k: v for k, v in os.environ.items() if k.startswith("RLSERVE_")}
            },
        },
    }
    threshold = int(args.get("affinity_threshold", DEFAULT_LOAD_THRESHOLD))
    if threshold <= 0:
        raise ValueError(f"affinity_threshold must be positive, got {threshold}")
    if str(args.get("sticky_sessions", "")).lower() in ("1", "true", "yes"):
        # Sticky where it helps (the replica's prefix cache holds the episode so far);
        # correctness never depends on it: any replica serves any session.
        options["request_router_config"] = {
            "request_router_class": STICKY_ROUTER,
            "request_router_kwargs": {
                "num_fallback_replicas": 2,
                "load_threshold": threshold,
            },
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
