"""The Ray Serve config file is valid for Ray Serve (its own schema), and the application it
names builds the deployment it describes; `build` refuses several replicas without a shared
session store, and a proxy beyond loopback (or out of its sight) without API keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray", reason="ray is installed with the distributed extra")
CONFIG = Path(__file__).resolve().parents[2] / "docker" / "ray-serve.yaml"


def test_the_serve_config_follows_ray_serves_schema(monkeypatch):
    from ray.serve.schema import ServeDeploySchema

    from app.deploy.ray_serve import STICKY_ROUTER, build

    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = config.applications
    assert application.import_path == "app.deploy.ray_serve:build"
    for name, value in application.runtime_env["env_vars"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "k")  # the cluster's (the file's header)
    built = build(application.args)
    deployment = built._bound_deployment
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    options = deployment.ray_actor_options
    assert options["num_gpus"] == 1 and options["num_cpus"] == 4
    env = options["runtime_env"]["env_vars"]
    assert env["RLSERVE_STORAGE__SESSION_STORE"] == "redis://redis:6379/0"
    router = deployment._deployment_config.request_router_config
    assert router.request_router_class == STICKY_ROUTER
    from ray.serve.experimental.consistent_hash_router import ConsistentHashRouter

    from app.deploy.affinity import DEFAULT_LOAD_THRESHOLD, LoadGatedAffinity

    assert router.get_request_router_class() is LoadGatedAffinity
    assert issubclass(LoadGatedAffinity, ConsistentHashRouter)
    assert router.request_router_kwargs["load_threshold"] == DEFAULT_LOAD_THRESHOLD


def test_several_replicas_need_a_shared_store(monkeypatch):
    from app.deploy.ray_serve import build

    monkeypatch.delenv("RLSERVE_STORAGE__SESSION_STORE", raising=False)
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "k")
    with pytest.raises(ValueError, match="shared session store"):
        build({"replicas": 2})
    assert build({"replicas": 1}) is not None


def test_without_keys_only_a_loopback_proxy_builds(monkeypatch):
    """The config file's proxy (0.0.0.0, or any address `build` is not told) serves open
    only on purpose; `rlserve serve --replicas` on loopback starts, with a warning."""
    from ray.serve.schema import ServeDeploySchema

    from app.deploy.ray_serve import build
    from app.ops.auth import OpenStart

    for name in ("RLSERVE_AUTH__API_KEYS", "RLSERVE_AUTH__ADMIN_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    config = ServeDeploySchema.model_validate(yaml.safe_load(CONFIG.read_text()))
    (application,) = config.applications
    for name, value in application.runtime_env["env_vars"].items():
        monkeypatch.setenv(name, value)
    for args in (application.args, {"replicas": 1}, {"replicas": 1, "proxy_host": "0.0.0.0"}):
        with pytest.raises(OpenStart, match="RLSERVE_AUTH__API_KEYS"):
            build(args)
    assert build({"replicas": 1, "proxy_host": "127.0.0.1"}) is not None
    monkeypatch.setenv("RLSERVE_AUTH__ALLOW_NO_KEYS", "true")
    assert build(application.args) is not None
