"""`rlserve serve` as a real process: starts on the built-in model, serves, stops cleanly."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import SERVER_DEFAULTS, running_server

pytestmark = pytest.mark.slow


def server_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """The built-in model cached and the state kept under `tmp_path`, plus `settings` named
    `group__field` (`http__shutdown_timeout_s="1"`: RLSERVE_HTTP__SHUTDOWN_TIMEOUT_S)."""
    env = {
        "RLSERVE_MODELS__CACHE_DIR": str(tmp_path / "cache"),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path / "data"),
    }
    return env | {f"RLSERVE_{name.upper()}": value for name, value in settings.items()}


def test_serve_tiny_builtin_model_end_to_end(tmp_path):
    with running_server(env=server_env(tmp_path), log=tmp_path / "server.log") as server:
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
    assert "tiny built-in model" in log and "RLSERVE_MODELS__MODEL" in log
    assert "Application shutdown complete" in log
    # A first start says what it prepares, then where to reach the server and one request to
    # try; transformers' progress bars stay out of the log.
    assert "preparing builtin-v" in log
    assert f"ready: serving on {server.url} (docs: {server.url}/docs)" in log
    assert f"curl -s {server.url}/v1/generate" in log
    assert "Loading weights" not in log and "it/s]" not in log


def test_a_port_in_use_stops_the_start_before_any_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "app.cli", "serve", "--port", str(port)],
            env={**os.environ, **SERVER_DEFAULTS, **server_env(tmp_path)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "--port or RLSERVE_HTTP__PORT" in result.stderr
    # Nothing was loaded or built: the process stopped before the app started.
    assert "loading" not in result.stderr and not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("flags", "settings", "said"),
    [
        (["--host", "0.0.0.0"], {}, "no API keys, and the server would listen on 0.0.0.0"),
        (["--host", "0.0.0.0", "--replicas", "2"], {}, "would listen on 0.0.0.0"),
        ([], {"auth__api_keys": ""}, "RLSERVE_AUTH__API_KEYS is set but holds no key"),
        ([], {"auth__api_keys": " , "}, "auth.api_keys: is set but holds no key"),
        ([], {"api_keys": "k"}, "RLSERVE_API_KEYS is not read"),
    ],
)
def test_a_server_that_would_serve_open_by_mistake_does_not_start(tmp_path, flags, settings, said):
    """Beyond loopback without keys, or with a key list set to nothing, or under an old name:
    the start stops before anything binds or loads."""
    result = subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--port", "0", *flags],
        env={**os.environ, **SERVER_DEFAULTS, **server_env(tmp_path, **settings)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "rlserve: cannot start: " in result.stderr and said in result.stderr
    assert "listening on" not in result.stderr and not (tmp_path / "cache").exists()


def test_a_port_taken_before_the_server_binds_it_is_tried_again_on_another(tmp_path, monkeypatch):
    """The helper every suite starts servers with: a free port another suite's process takes
    first (CI runs suites side by side) costs a second start, not the test."""
    from tests.e2e import server as helpers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = iter([port, helpers.free_port()])
        monkeypatch.setattr(helpers, "free_port", lambda: next(ports))
        with helpers.running_server(env=server_env(tmp_path), log=tmp_path / "s.log") as server:
            assert not server.url.endswith(f":{port}")
            assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200


def test_idle_connections_outlive_the_clients_keep_alive(tmp_path):
    """An idle connection stays open longer than HTTP clients keep one for reuse (httpx: 5 s,
    the server's old default too): otherwise a request sent on it just as the server closes
    it is lost without an answer (seen under load as a read error on an env step)."""
    import http.client

    with running_server(env=server_env(tmp_path), log=tmp_path / "server.log") as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        try:
            for _ in range(3):  # one connection: a closed one raises RemoteDisconnected
                connection.request("GET", "/health")
                response = connection.getresponse()
                assert response.status == 200 and response.read()
                time.sleep(httpx.Limits().keepalive_expiry + 1)  # idle past the client's expiry
        finally:
            connection.close()


def test_serve_exits_when_the_model_cannot_load(tmp_path):
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path),
        "RLSERVE_MODELS__MODEL": str(tmp_path / "missing"),
    }
    log = tmp_path / "server.log"
    with (
        pytest.raises(RuntimeError, match="server exited early"),
        running_server(env=env, log=log, ready_timeout=60),
    ):
        pass
    assert "failed to load" in (tmp_path / "server.log").read_text()


def _generate_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    """POST /v1/generate from a thread; the dict gets the response and its end time."""
    result: dict = {}

    def request() -> None:
        result["response"] = httpx.post(f"{url}/v1/generate", json=body, timeout=300)
        result["finished"] = time.monotonic()

    worker = threading.Thread(target=request)
    worker.start()
    return worker, result


def test_ctrl_c_stops_the_server_as_sigterm_does(tmp_path):
    """SIGINT (Ctrl-C) shuts down gracefully, then ends the process at once with 130, as a
    shell reports an interrupted command: no traceback, no wait for the interpreter to tear
    the models down."""
    with running_server(env=server_env(tmp_path), log=tmp_path / "server.log") as server:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(timeout=30) == 130
    log = (tmp_path / "server.log").read_text()
    assert "Application shutdown complete" in log
    assert "Traceback" not in log and "KeyboardInterrupt" not in log


def test_sigterm_lets_in_flight_requests_finish(tmp_path):
    # A grace no loaded CI machine runs out of: this test is about what happens inside it.
    env = server_env(tmp_path, http__shutdown_timeout_s="300")
    with running_server(env=env, log=tmp_path / "server.log") as server:
        # Some seconds of decoding: still running when the signal comes.
        body = {"tokens": [[1, 2, 3]] * 16, "max_tokens": 600, "ignore_eos": True}
        worker, result = _generate_in_background(server.url, body)
        time.sleep(0.5)  # the request is being served
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # no new connections once shutting down
            httpx.get(f"{server.url}/health", timeout=2)
        worker.join(timeout=300)
        response = result["response"]
        assert response.status_code == 200
        assert result["finished"] > signalled  # it was in flight
        assert all(len(s[0]["tokens"]["response"]) == 600 for s in response.json()["outputs"])
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in (tmp_path / "server.log").read_text()


def test_a_request_outliving_the_shutdown_grace_gets_a_retryable_503(tmp_path):
    env = server_env(tmp_path, http__shutdown_timeout_s="1")
    with running_server(env=env, log=tmp_path / "server.log") as server:
        # Minutes of decoding: far longer than the grace.
        body = {"tokens": [[1, 2, 3]] * 32, "max_tokens": 4000, "ignore_eos": True}
        worker, result = _generate_in_background(server.url, body)
        time.sleep(0.5)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        worker.join(timeout=120)
        response = result["response"]
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"
        assert response.headers["x-request-id"]
        error = response.json()["error"]
        assert error["type"] == "unavailable_error"
        assert "shutting down" in error["message"]
        # Decoding stopped at the cancel: the process is gone soon after, not minutes later.
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 30
    log = (tmp_path / "server.log").read_text()
    assert "timeout graceful shutdown exceeded" in log
    assert "Application shutdown complete" in log
