"""The vLLM engine's processes start with the server and are gone after SIGTERM or Ctrl-C."""

from __future__ import annotations

import importlib.util
import signal
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import running_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def descendants(pid: int) -> set[int]:
    """All processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_engine_processes_end_with_the_server(tmp_path, stop):
    env = {
        "RLSERVE_MODELS__CACHE_DIR": str(tmp_path / "cache"),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path / "data"),
        "RLSERVE_MODELS__BACKEND": "vllm",
        "RLSERVE_MODELS__DTYPE": "float32",
        "RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES": str(256 << 20),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    with running_server(env=env, log=tmp_path / "server.log", ready_timeout=300) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["models"]
        assert models[0]["backend"] == "vllm"
        body = {"tokens": [[1, 2, 3]], "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).status_code == 200
        engine_processes = descendants(server.process.pid)
        assert engine_processes, "vLLM runs its engine core in a child process"
        server.process.send_signal(stop)
        server.process.wait(timeout=60)
    deadline = time.monotonic() + 30
    while alive(engine_processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(engine_processes), (tmp_path / "server.log").read_text()[-3000:]
