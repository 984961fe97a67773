"""rlserve as 2 replicas on Ray Serve (a local Ray cluster) with sessions in a real
redis-server: requests spread over both replicas, each labels its answers and metrics, and an
environment episode survives the replica that served it being killed (Ray starts another; no
completed step is lost)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server, free_port, running_process
from tests.stores.redis_server import running_redis

ray = pytest.importorskip("ray", reason="ray is installed with the distributed extra")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is missing"),
]
RAY = str(Path(sys.executable).parent / "ray")
# A local test cluster without token authentication (the servers and this test use it alike).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DISABLE_USAGE_STATS": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray head node (stopped with `ray stop` afterwards); its address."""
    port = free_port()
    env = {**os.environ, **RAY_ENV}
    command = [
        RAY,
        "start",
        "--head",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=4",
        "--include-dashboard=false",
    ]
    subprocess.run(command, check=True, capture_output=True, env=env, timeout=120)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def server(cluster: str, tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("ray-serve")
    with running_redis(tmp) as redis_url:
        port = free_port()
        env = {
            "RAY_ADDRESS": cluster,
            **RAY_ENV,
            "RLSERVE_CACHE_DIR": str(settings.cache_dir),
            "RLSERVE_DATA_DIR": str(tmp / "data"),
            "RLSERVE_SESSION_STORE": redis_url,
            "RLSERVE_BACKEND": "transformers",
        }
        command = [sys.executable, "-m", "app.cli", "serve", "--replicas", "2", "--port", str(port)]
        with running_process(
            command, port, "/ready", env=env, log=tmp / "serve.log", timeout=300
        ) as running:
            wait_for_replicas(running.url, 2)
            yield running


def replicas_answering(url: str, tries: int = 40) -> set[str]:
    seen = set()
    for _ in range(tries):
        response = httpx.get(f"{url}/ready", timeout=30)
        if response.status_code == 200:
            seen.add(response.headers["x-rlserve-replica"])
    return seen


def wait_for_replicas(url: str, count: int, timeout: float = 240) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = replicas_answering(url, 10)
        if len(seen) >= count:
            return seen
        time.sleep(1)
    raise AssertionError(f"fewer than {count} replicas became ready")


def test_requests_spread_over_both_replicas(server: Server) -> None:
    seen = replicas_answering(server.url)
    assert len(seen) == 2
    labels = set()
    for _ in range(20):
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        labels |= {line for line in text.splitlines() if line.startswith("target_info{")}
    assert labels == {f'target_info{{replica="{r}"}} 1.0' for r in seen}


def test_an_episode_survives_its_replica_being_killed(
    server: Server, cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlserve_client import Client

    with Client(base_url=server.url, max_retries=8) as client:
        env_id = client.create_env(kind="tokens").env_id
        client.reset_env(env_id, tokens=[[5, 6]])
        for step in range(2):
            client.step_env(env_id, actions=[{"tokens": [7 + step]}])
        state = client.get_env(env_id)
        assert state.rows[0].turns == 2
        victim = httpx.get(f"{server.url}/ready", timeout=30).headers["x-rlserve-replica"]
        for name, value in RAY_ENV.items():
            monkeypatch.setenv(name, value)
        ray.init(address=cluster, namespace="serve", log_to_driver=False)
        try:
            names = [
                a["name"]
                for a in ray.util.list_named_actors(all_namespaces=True)
                if victim in a["name"]
            ]
            assert len(names) == 1, names
            ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
        finally:
            ray.shutdown()
        for step in range(2, 5):  # served by the survivor while Ray starts a replacement
            result = client.step_env(env_id, actions=[{"tokens": [7 + step]}])
        assert result.outputs[0].observation.prompt_tokens == [5, 6, 7, 8, 9, 10, 11]
        assert client.get_env(env_id).rows[0].turns == 5
    seen = wait_for_replicas(server.url, 2)
    assert victim not in seen  # the killed replica was replaced by a new one
