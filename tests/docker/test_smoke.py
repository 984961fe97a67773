"""The CPU image built and run for real (scripts/docker-smoke.sh): the checks it makes are in
scripts/docker_smoke.py. Runs where a Docker engine answers or can be started (root with
dockerd) and Docker Compose v2 is installed (scripts/docker-deps.sh installs both from
Debian); CI installs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _missing() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client (scripts/docker-deps.sh installs one)"
    engine = subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    if not engine and not (os.geteuid() == 0 and shutil.which("dockerd")):
        return "no Docker engine answers, and none can be started here"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "no Docker Compose v2 (scripts/docker-deps.sh installs it)"
    return None


pytestmark = [
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.timeout(1900),  # the build's own limit below, and then some
    pytest.mark.skipif((why := _missing()) is not None, reason=why or ""),
]


def test_the_cpu_image_builds_runs_and_passes_every_check(tmp_path: Path) -> None:
    report = tmp_path / "smoke.json"
    done = subprocess.run(
        [str(ROOT / "scripts/docker-smoke.sh"), "--json", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    print(done.stdout)
    result = json.loads(report.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert done.returncode == 0 and not failed, (failed, done.stdout[-4000:], done.stderr[-4000:])
    names = {c["check"] for c in result["checks"]}
    assert names == {
        "healthcheck",
        "generate",
        "logprobs",
        "python tool isolated in the container",
        "server runs as non-root",
        "session survives restart",
        "graceful stop",
        "torn down",
    }
