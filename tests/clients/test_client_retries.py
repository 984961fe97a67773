"""Which calls the client sends again, and how: a call that changes state is repeated only
when the first try never left, except env steps, whose idempotency key lets the server answer
a repeat as it answered the original. Also: the 403 class, `timeout=None`, streamed uploads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rlserve_client import (
    NOT_GIVEN,
    APIConnectionError,
    Client,
    NotFoundError,
    PermissionDeniedError,
    ServiceUnavailableError,
)
from rlserve_client import _weight_routes as weight_routes
from rlserve_client._base import request_arguments

HEALTHY = {"status": "ok", "model_status": "ready"}


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr("rlserve_client._base.retry_delay", lambda attempt, response: 0.0)


def failing(
    error: Callable[[httpx.Request], Exception] | None, status: int = 503, times: int = 1
) -> tuple[list[httpx.Request], httpx.MockTransport]:
    """Fails the first `times` requests with `error` (or answers `status`), then answers:
    health as healthy, a step as an empty step, anything else 404 (a typed error that shows
    the request got through)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        if len(seen) <= times:
            if error is not None:
                raise error(request)
            body = {"error": {"message": "no", "type": "x", "param": None, "code": status}}
            return httpx.Response(status, json=body, headers={"Retry-After": "0"})
        if request.url.path.endswith("/step"):
            return httpx.Response(200, json={"env_id": "e", "policy_version": 0, "outputs": []})
        if request.url.path == "/health":
            return httpx.Response(200, json=HEALTHY)
        missing = {"message": "gone", "type": "not_found_error", "param": None, "code": 404}
        return httpx.Response(404, json={"error": missing})

    return seen, httpx.MockTransport(handler)


def read_error(request: httpx.Request) -> Exception:
    return httpx.ReadError("connection reset after sending", request=request)


def read_timeout(request: httpx.Request) -> Exception:
    return httpx.ReadTimeout("no answer", request=request)


def connect_error(request: httpx.Request) -> Exception:
    return httpx.ConnectError("refused", request=request)


STATEFUL: list[tuple[str, Callable[[Client], object]]] = [
    ("create_env", lambda c: c.create_env(max_turns=1)),
    ("reset_env", lambda c: c.reset_env("env-1", query=["q"])),
    ("rollouts", lambda c: c.rollouts(num_episodes=1, env_id="env-1")),
    ("upload_weights", lambda c: c.upload_weights(payload=b"x" * 10)),
    ("load_weights", lambda c: c.load_weights(path="/w")),
]


@pytest.mark.parametrize("name", [n for n, _ in STATEFUL])
@pytest.mark.parametrize("error", [read_error, read_timeout, None])
def test_a_state_changing_call_is_not_repeated_once_sent(name, error):
    call = dict(STATEFUL)[name]
    seen, transport = failing(error)
    client = Client(base_url="http://x", transport=transport, max_retries=3)
    with pytest.raises((APIConnectionError, ServiceUnavailableError)):
        call(client)
    assert len(seen) == 1, name


@pytest.mark.parametrize("name", [n for n, _ in STATEFUL])
def test_a_state_changing_call_that_never_left_is_sent_again(name):
    seen, transport = failing(connect_error, times=2)
    client = Client(base_url="http://x", transport=transport, max_retries=3)
    with pytest.raises(NotFoundError):  # the third try got through
        dict(STATEFUL)[name](client)
    assert len(seen) == 3


@pytest.mark.parametrize("error", [read_error, read_timeout, None])
def test_a_step_is_retried_with_the_same_idempotency_key(error):
    seen, transport = failing(error, times=2)
    client = Client(base_url="http://x", transport=transport, max_retries=3)
    client.step_env("env-1", actions=[{"text": "a"}])
    client.step_env("env-1", actions=[{"text": "a"}])
    keys = [r.headers["idempotency-key"] for r in seen]
    assert len(keys) == 4 and len(set(keys[:3])) == 1  # one step, sent three times
    assert keys[3] != keys[0]  # the next step is a new step


def test_403_is_its_own_class():
    seen, transport = failing(None, status=403, times=9)
    client = Client(base_url="http://x", transport=transport)
    with pytest.raises(PermissionDeniedError) as denied:
        client.load_weights(path="/w")
    assert denied.value.status_code == 403 and len(seen) == 1


def test_timeout_none_means_no_timeout_and_not_given_the_client_default():
    seen, transport = failing(None, times=0)
    client = Client(base_url="http://x", transport=transport, timeout=7.0)
    client.health(timeout=None)
    client.health()
    client.health(timeout=NOT_GIVEN)
    client.health(timeout=2.5)
    timeouts = [r.extensions["timeout"] for r in seen]
    assert timeouts[0] == {"connect": None, "read": None, "write": None, "pool": None}
    assert timeouts[1] == timeouts[2] == {"connect": 7.0, "read": 7.0, "write": 7.0, "pool": 7.0}
    assert timeouts[3]["read"] == 2.5


def test_upload_from_a_path_streams_the_file(tmp_path: Path, monkeypatch):
    payload = bytes(range(256)) * (5 * 4096 + 17)  # ~5 MiB, not a multiple of the chunk
    path = tmp_path / "w.safetensors"
    path.write_bytes(payload)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read whole"))
    arguments = request_arguments(weight_routes.upload_weights(payload=path, progress=False))
    chunks = [len(c) for c in arguments["content"]]  # what httpx will send, piece by piece
    assert arguments["headers"]["Content-Length"] == str(len(payload))
    assert sum(chunks) == len(payload) and max(chunks) == 1 << 20
    received = bytearray()

    def handler(request: httpx.Request) -> httpx.Response:
        received.extend(request.read())
        updated = {"model": "policy", "num_tensors": 1, "num_bytes": len(payload)}
        return httpx.Response(200, json={**updated, "policy_version": 1, "reference_version": 0})

    client = Client(base_url="http://x", transport=httpx.MockTransport(handler))
    assert client.upload_weights(payload=path, progress=False).num_bytes == len(payload)
    assert bytes(received) == payload
