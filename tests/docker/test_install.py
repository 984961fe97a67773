"""The CPU image's install steps (scripts/install.sh, which docker/Dockerfile.cpu runs), run
outside Docker into a fresh environment: the result serves the same API."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_dockerfile_cpu_runs_the_shared_install_script():
    text = (ROOT / "docker" / "Dockerfile.cpu").read_text().replace("\\\n", " ")
    runs = [line for line in text.splitlines() if line.startswith("RUN")]
    assert any("./scripts/install.sh /opt/venv" in run for run in runs)


@pytest.mark.beside  # (a long wait on pip: in the extra suites' lane in a full run)
@pytest.mark.timeout(1000)  # the install's own limit below, and then some
def test_install_script_builds_a_working_environment(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([str(ROOT / "scripts" / "install.sh"), str(venv)], check=True, timeout=900)
    spec = subprocess.run(
        [str(venv / "bin" / "rlserve"), "export-openapi", "-"],
        cwd=tmp_path,  # not the checkout: the installed package must stand alone
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(spec) == json.loads((ROOT / "openapi" / "openapi.json").read_text())
    # no test or benchmark tools in the image
    installed = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert {"torch", "vllm", "transformers", "fastapi"} & names == {
        "torch",
        "transformers",
        "fastapi",
    }
    assert not {"pytest", "matplotlib", "schemathesis"} & names
