"""rlserve on Ray Serve: each replica is a whole rlserve engine (the policy and the reference,
on the replica's own devices) behind Ray Serve's HTTP proxy, which spreads requests over the
replicas; Ray checks their health and restarts the ones that fail, and autoscales between
the bounds given. Sessions and trajectories must then live in a store every replica shares
(`RLSERVE_SESSION_STORE=redis://...`): any replica serves any session.

    rlserve serve --replicas 2 ...                  # a local Ray cluster (or RAY_ADDRESS)
    serve run app.deploy.ray_serve:build replicas=2 # Ray's own CLI; args as key=value
    serve deploy docker/ray-serve.yaml              # a config file (KubeRay: docker/kuberay.yaml)

Settings come from each replica's environment (RLSERVE_*) and from the application's args,
whose keys are Settings fields; `replicas`, `min_replicas`, `max_replicas`, `num_cpus` and
`num_gpus` shape the deployment."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from ray import serve
from ray.serve import Application

from app.config import Settings
from app.main import create_app

DEPLOYMENT = "rlserve"
_SHAPE = (
    "replicas",
    "min_replicas",
    "max_replicas",
    "target_ongoing_requests",
    "num_cpus",
    "num_gpus",
)


@serve.ingress()
class RLServeReplica:
    """One replica: the rlserve app, built on the replica (its lifespan loads the models).
    (`app` is the ingress wrapper's own attribute: ours is `server`.)"""

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.overrides = overrides
        self.server: FastAPI | None = None

    def __serve_build_asgi_app__(self) -> FastAPI:
        replica = serve.get_replica_context().replica_id.unique_id
        settings = Settings(**{**self.overrides, "replica_id": replica})
        self.server = create_app(settings)
        return self.server

    async def check_health(self) -> None:
        """Ray's health check: raise while the engine is not ready or does not answer (Ray
        restarts a replica that keeps failing it)."""
        if self.server is None:
            return
        problem = await self.server.state.probe.problem()
        if problem is not None and self.server.state.registry.status != "loading":
            raise RuntimeError(problem)


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
        "health_check_period_s": 10,
        "health_check_timeout_s": settings.ready_probe_timeout_s + 5,
        "graceful_shutdown_timeout_s": settings.shutdown_timeout_s,
        "ray_actor_options": {
            "num_cpus": float(args.get("num_cpus", 1)),
            "num_gpus": float(args.get("num_gpus", 0)),
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
    return deployment.bind(overrides)
