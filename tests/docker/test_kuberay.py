"""docker/kuberay.yaml, checked offline: every Kubernetes object and pod template against
Kubernetes' own schema (kubernetes-validate), the RayService's fields against the ray.io/v1
API of KubeRay 1.7 (the fields of its CRD, written out below), and the embedded Serve config
against Ray Serve's schema, equal to docker/ray-serve.yaml and built by the application."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "docker" / "kuberay.yaml"
KUBERNETES = "1.30.0"

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_INT = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_POD_TEMPLATE = {"type": "object"}  # checked against Kubernetes' schema separately
_HEAD_GROUP = {
    "type": "object",
    "required": ["template"],
    "additionalProperties": False,
    "properties": {
        "template": _POD_TEMPLATE,
        "headService": {"type": "object"},
        "enableIngress": {"type": "boolean"},
        "ingressOptions": {"type": "object"},
        "resources": _STRINGS,
        "labels": _STRINGS,
        "rayStartParams": _STRINGS,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
    },
}
_WORKER_GROUP = {
    "type": "object",
    "required": ["groupName", "minReplicas", "maxReplicas", "template"],
    "additionalProperties": False,
    "properties": {
        "suspend": {"type": "boolean"},
        "groupName": {"type": "string", "minLength": 1},
        "replicas": _INT,
        "minReplicas": _INT,
        "maxReplicas": _INT,
        "idleTimeoutSeconds": _INT,
        "priority": _INT,
        "resources": _STRINGS,
        "labels": _STRINGS,
        "rayStartParams": _STRINGS,
        "template": _POD_TEMPLATE,
        "scaleStrategy": {"type": "object"},
        "numOfHosts": {"type": "integer", "minimum": 1},
    },
}
_CLUSTER = {
    "type": "object",
    "required": ["headGroupSpec"],
    "additionalProperties": False,
    "properties": {
        "upgradeStrategy": {"type": "object"},
        "authOptions": {"type": "object"},
        "suspend": {"type": "boolean"},
        "managedBy": {"type": "string"},
        "autoscalerOptions": {"type": "object"},
        "headServiceAnnotations": _STRINGS,
        "enableInTreeAutoscaling": {"type": "boolean"},
        "gcsFaultToleranceOptions": {"type": "object"},
        "historyServerOptions": {"type": "object"},
        "networkPolicy": {"type": "object"},
        "tlsOptions": {"type": "object"},
        "headGroupSpec": _HEAD_GROUP,
        "rayVersion": {"type": "string"},
        "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
    },
}
RAY_SERVICE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["rayClusterConfig"],
            "additionalProperties": False,
            "properties": {
                "rayClusterDeletionDelaySeconds": _INT,
                "serviceUnhealthySecondThreshold": _INT,
                "deploymentUnhealthySecondThreshold": _INT,
                "serveService": {"type": "object"},
                "upgradeStrategy": {
                    "type": "object",
                    "properties": {
                        "type": {"enum": ["NewCluster", "NewClusterWithIncrementalUpgrade", "None"]}
                    },
                },
                "managedBy": {"type": "string"},
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": _CLUSTER,
                "excludeHeadPodFromServeSvc": {"type": "boolean"},
                "suspend": {"type": "boolean"},
            },
        },
    },
}


def documents() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def ray_service() -> dict[str, Any]:
    (service,) = [d for d in documents() if d["kind"] == "RayService"]
    return service


def pod_templates(service: dict[str, Any]) -> list[dict[str, Any]]:
    cluster = service["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster.get("workerGroupSpecs", [])]
    return [group["template"] for group in groups]


def as_pod(template: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": template.get("metadata", {"name": "template"}),
        "spec": template["spec"],
    }


def test_the_kubernetes_objects_follow_kubernetes_schema() -> None:
    others = [d for d in documents() if d["kind"] != "RayService"]
    assert {d["kind"] for d in others} == {"Service", "Deployment"}
    for document in others:
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    for template in pod_templates(ray_service()):
        kubernetes_validate.validate(as_pod(template), KUBERNETES, strict=True)


def test_the_ray_service_follows_kuberays_api() -> None:
    service = ray_service()
    jsonschema.validate(service, RAY_SERVICE)
    import ray

    assert service["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "num-cpus"), 0),
        (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplica"), 4),
        (("spec", "serveConfig"), "applications: []"),
    ],
)
def test_the_checks_catch_a_wrong_field(path: tuple[Any, ...], value: Any) -> None:
    """A number where KubeRay wants a string, a misspelt field, a removed field (the checks
    can fail)."""
    service = copy.deepcopy(ray_service())
    node = service
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(service, RAY_SERVICE)


def test_a_pod_template_error_is_caught() -> None:
    template = copy.deepcopy(pod_templates(ray_service())[1])
    template["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(as_pod(template), KUBERNETES, strict=True)


def test_the_embedded_serve_config_is_the_ray_serve_file(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray", reason="ray is installed with the distributed extra")
    from ray.serve.schema import ServeDeploySchema

    from app.deploy.ray_serve import build

    embedded = yaml.safe_load(ray_service()["spec"]["serveConfigV2"])
    assert embedded == yaml.safe_load((ROOT / "docker" / "ray-serve.yaml").read_text())
    (application,) = ServeDeploySchema.model_validate(embedded).applications
    for name, value in application.runtime_env["env_vars"].items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "k")  # the Secret's (below)
    deployment = build(application.args)._bound_deployment
    needs = deployment.ray_actor_options
    worker = pod_templates(ray_service())[1]["spec"]["containers"][0]["resources"]["requests"]
    # A worker pod holds a replica: its CPUs and GPU.
    assert float(worker["cpu"]) >= needs["num_cpus"]
    assert float(worker["nvidia.com/gpu"]) >= needs["num_gpus"]
    cluster = ray_service()["spec"]["rayClusterConfig"]
    autoscaling = deployment._deployment_config.autoscaling_config
    assert cluster["workerGroupSpecs"][0]["maxReplicas"] >= autoscaling.max_replicas


def test_every_pod_that_builds_or_serves_takes_its_keys_from_the_secret() -> None:
    """The proxy listens beyond loopback: the head (which builds the application) and the
    workers (its replicas) read the API keys from the Secret, required; admin keys optional."""
    for template in pod_templates(ray_service()):
        (container,) = template["spec"]["containers"]
        env = {item["name"]: item["valueFrom"]["secretKeyRef"] for item in container["env"]}
        assert env["RLSERVE_AUTH__API_KEYS"] == {"name": "rlserve-keys", "key": "api-keys"}
        assert env["RLSERVE_AUTH__ADMIN_API_KEYS"]["optional"] is True
