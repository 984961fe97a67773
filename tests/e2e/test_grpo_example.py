"""`examples/grpo_loop.py` runs end to end against a real server (short)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parents[2] / "examples" / "grpo_loop.py"


def test_grpo_example_learns_and_pushes_weights(tmp_path, settings):
    env = {"RLSERVE_CACHE_DIR": str(settings.cache_dir), "RLSERVE_DATA_DIR": str(tmp_path)}
    with running_server(env=env, log=tmp_path / "server.log") as server:
        command = [sys.executable, str(EXAMPLE), "--url", server.url, "--iterations", "2"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].endswith("at version 0; 2 groups of 4")
    assert lines[1].startswith("iteration 0: 8 episodes") and lines[1].find("-> 1 (") > 0
    assert lines[2].startswith("iteration 1: 8 episodes") and lines[2].find("-> 2 (") > 0
