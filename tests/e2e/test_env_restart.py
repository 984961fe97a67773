"""A server killed with SIGKILL loses no completed environment step."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.slow


def test_sessions_survive_kill_9(tmp_path):
    env = {
        "RLSERVE_MODELS__CACHE_DIR": str(tmp_path / "cache"),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path / "data"),
    }
    with running_server(env=env, log=tmp_path / "first.log") as server:
        url = server.url
        created = httpx.post(f"{url}/v1/envs", json={"batch_size": 2, "max_turns": 3}).json()
        env_id = created["env_id"]
        httpx.post(f"{url}/v1/envs/{env_id}/reset", json={"query": ["a", "b"]}).raise_for_status()
        step = httpx.post(
            f"{url}/v1/envs/{env_id}/step", json={"actions": [{"text": "one"}, {"text": "uno"}]}
        )
        step.raise_for_status()
        before = httpx.get(f"{url}/v1/envs/{env_id}").json()
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
    with running_server(env=env, log=tmp_path / "second.log") as server:
        after = httpx.get(f"{server.url}/v1/envs/{env_id}").json()
        assert after["rows"] == before["rows"]
        assert [r["turns"] for r in after["rows"]] == [1, 1]
        step = httpx.post(
            f"{server.url}/v1/envs/{env_id}/step",
            json={"actions": [{"text": "two"}, {"text": "dos"}]},
        ).json()
        history = step["outputs"][0]["observation"]["history"]
        assert [m["content"] for m in history] == ["a", "one", "two"]
