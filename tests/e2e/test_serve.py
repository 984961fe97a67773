"""`rlserve serve` as a real process: starts on the built-in model, serves, stops cleanly."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from tests.e2e.server import running_server

pytestmark = pytest.mark.slow


def test_serve_builtin_model_end_to_end(tmp_path):
    env = {"RLSERVE_CACHE_DIR": str(tmp_path / "cache"), "RLSERVE_DATA_DIR": str(tmp_path / "data")}
    with running_server(env=env, log=tmp_path / "server.log") as server:
        assert server.startup_seconds < 60
        models = httpx.get(f"{server.url}/v1/models").json()
        assert models["models"][0]["builtin"] is True
        body = {"text": ["Hello"], "max_tokens": 4, "temperature": 0}
        generated = httpx.post(f"{server.url}/v1/generate", json=body, timeout=30).json()
        full = generated["outputs"][0][0]["tokens"]["full"]
        scored = httpx.post(f"{server.url}/v1/logprobs", json={"tokens": [full]}, timeout=30)
        assert len(scored.json()["outputs"][0]["log_probs"]["full"]) == len(full)
        bad = httpx.post(f"{server.url}/v1/logprobs", json={"tokens": [[999]]})
        assert bad.status_code == 422
        assert httpx.get(f"{server.url}/ready").status_code == 200
        server.process.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal it caught
        assert server.process.wait(timeout=30) in (0, -signal.SIGTERM)
    log = (tmp_path / "server.log").read_text()
    assert "built-in demo model" in log and "RLSERVE_MODEL" in log
    assert "Application shutdown complete" in log


def test_serve_exits_when_the_model_cannot_load(tmp_path):
    env = {"RLSERVE_DATA_DIR": str(tmp_path), "RLSERVE_MODEL": str(tmp_path / "missing")}
    log = tmp_path / "server.log"
    with (
        pytest.raises(RuntimeError, match="server exited early"),
        running_server(env=env, log=log, ready_timeout=60),
    ):
        pass
    assert "failed to load" in (tmp_path / "server.log").read_text()


def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    env = {"RLSERVE_CACHE_DIR": str(tmp_path / "cache"), "RLSERVE_DATA_DIR": str(tmp_path / "data")}
    with running_server(env=env, log=tmp_path / "server.log") as server:
        # Long enough to still be running when the signal comes, even on a loaded machine.
        body = {"tokens": [[1, 2, 3]] * 32, "max_tokens": 1500, "ignore_eos": True}
        result: dict[str, httpx.Response] = {}  # and "finished": its end time

        def slow_request() -> None:
            result["response"] = httpx.post(f"{server.url}/v1/generate", json=body, timeout=120)
            result["finished"] = time.monotonic()  # type: ignore[assignment]

        worker = threading.Thread(target=slow_request)
        worker.start()
        time.sleep(0.5)  # the request is being served
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no new connections once shutting down
            httpx.get(f"{server.url}/health", timeout=2)
        worker.join(timeout=120)
        response = result["response"]
        assert response.status_code == 200
        assert result["finished"] > signalled  # type: ignore[operator]  # it was in flight
        assert all(len(s[0]["tokens"]["response"]) == 1500 for s in response.json()["outputs"])
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in (tmp_path / "server.log").read_text()
