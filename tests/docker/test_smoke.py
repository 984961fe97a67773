"""The CPU image built and run for real (scripts/docker-smoke.sh): the checks it makes are in
scripts/docker_smoke.py. Runs where a Docker engine answers or can be started (root with
dockerd) and Docker Compose v2 is installed (scripts/docker-deps.sh installs both from
Debian); CI installs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
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


# Set by scripts/test.sh, which starts the smoke run in the background while the venvs build
# and the linters run (it mostly waits on package downloads): this test then checks that run
# instead of making another. Its exit status lands in the report's path plus ".rc".
STARTED = os.environ.get("RLSERVE_DOCKER_SMOKE_REPORT")


def smoke_run(report: Path) -> tuple[int, str]:
    """scripts/docker-smoke.sh's exit status and output, with its JSON report at `report`."""
    done = subprocess.run(
        [str(ROOT / "scripts/docker-smoke.sh"), "--json", str(report)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1800,
    )
    return done.returncode, done.stdout


def started_run(report: Path) -> tuple[int, str]:
    """The same for the run scripts/test.sh started, once it has finished."""
    status = Path(f"{report}.rc")
    deadline = time.monotonic() + 1800
    while not status.exists():
        assert time.monotonic() < deadline, "the smoke run scripts/test.sh started never finished"
        time.sleep(1)
    return int(status.read_text()), Path(f"{report}.log").read_text()


def test_the_cpu_image_builds_runs_and_passes_every_check(tmp_path: Path) -> None:
    report = Path(STARTED) if STARTED else tmp_path / "smoke.json"
    code, output = started_run(report) if STARTED else smoke_run(report)
    print(output)
    assert report.exists(), output[-4000:]
    result = json.loads(report.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert code == 0 and not failed, (failed, output[-8000:])
    names = {c["check"] for c in result["checks"]}
    assert names == {
        "refuses to start: no API keys on 0.0.0.0",
        "refuses to start: the old key name",
        "refuses to start: a misspelt key name",
        "keys required",
        "healthcheck",
        "generate",
        "logprobs",
        "python tool isolated in the container",
        "server runs as non-root",
        "session survives restart",
        "graceful stop",
        "torn down",
    }
