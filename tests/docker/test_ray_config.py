"""The Ray Serve config file is valid for Ray Serve (its own schema), and the application it
names builds the deployment it describes; `build` refuses several replicas without a shared
session store."""

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
    assert router.get_request_router_class().__name__ == "ConsistentHashRouter"


def test_several_replicas_need_a_shared_store(monkeypatch):
    from app.deploy.ray_serve import build

    monkeypatch.delenv("RLSERVE_STORAGE__SESSION_STORE", raising=False)
    with pytest.raises(ValueError, match="shared session store"):
        build({"replicas": 2})
    assert build({"replicas": 1}) is not None
