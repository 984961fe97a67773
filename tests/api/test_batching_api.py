"""Batching through the HTTP API: errors, overload, disconnects, live state, equal values."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from app.common.disconnect import cancel_on_disconnect
from app.config import Settings
from app.main import create_app
from tests.conftest import assert_close, started


@pytest.fixture
async def small_queue_app(settings: Settings) -> AsyncIterator[FastAPI]:
    app = create_app(settings.replace(batching={"max_queue": 1, "max_batch_size": 4}))
    async with app.router.lifespan_context(app):
        await started(app)
        yield app


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


async def test_backend_error_is_a_500_for_that_call_only(small_queue_app, monkeypatch):
    served = small_queue_app.state.registry.get("policy")
    real_score = served.backend.score

    async def flaky(sequences):  # type: ignore[no-untyped-def]
        if any(seq[0] == 13 for seq in sequences):
            raise RuntimeError("CUDA out of memory (simulated)")
        return await real_score(sequences)

    monkeypatch.setattr(served.backend, "score", flaky)
    async with client_for(small_queue_app) as client:
        bad = await client.post("/v1/logprobs", json={"tokens": [[13, 1, 2]]})
        assert bad.status_code == 500
        error = bad.json()["error"]
        assert error["type"] == "backend_error"
        assert "CUDA out of memory (simulated)" in error["message"]
        assert "Traceback" not in bad.text
        good = await client.post("/v1/logprobs", json={"tokens": [[14, 1, 2]]})
        assert good.status_code == 200


async def test_full_queue_answers_503_with_retry_after(small_queue_app, monkeypatch):
    served = small_queue_app.state.registry.get("policy")
    gate = asyncio.Event()
    real_score = served.backend.score

    async def gated(sequences):  # type: ignore[no-untyped-def]
        await gate.wait()
        return await real_score(sequences)

    monkeypatch.setattr(served.backend, "score", gated)
    async with client_for(small_queue_app) as client:
        running = asyncio.create_task(client.post("/v1/logprobs", json={"tokens": [[1, 2]]}))
        await asyncio.sleep(0.05)  # taken into the (blocked) call
        waiting = asyncio.create_task(client.post("/v1/logprobs", json={"tokens": [[3, 4]]}))
        await asyncio.sleep(0.05)  # queued: the queue is now full
        refused = await client.post("/v1/logprobs", json={"tokens": [[5, 6]]})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded_error"
        gate.set()
        assert (await running).status_code == 200
        assert (await waiting).status_code == 200


class _ConnectedRequest:
    """A client that stays connected until `disconnect` is set."""

    def __init__(self) -> None:
        self.disconnect = asyncio.Event()

    async def receive(self) -> dict[str, str]:
        await self.disconnect.wait()
        return {"type": "http.disconnect"}


async def _cancellable_work(cancelled: asyncio.Event) -> int:
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return 1


async def test_disconnect_cancels_queued_work():
    request, cancelled = _ConnectedRequest(), asyncio.Event()
    task = asyncio.create_task(cancel_on_disconnect(request, _cancellable_work(cancelled)))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    request.disconnect.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()


async def test_cancelling_the_request_cancels_its_work():
    """As uvicorn does when the shutdown grace is over: the client is still there, and the
    work must not run on (or it keeps the process from exiting)."""
    request, cancelled = _ConnectedRequest(), asyncio.Event()
    task = asyncio.create_task(cancel_on_disconnect(request, _cancellable_work(cancelled)))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cancelled.is_set()
    left = [t.get_coro().__qualname__ for t in asyncio.all_tasks() if not t.done()]  # type: ignore[union-attr]
    assert "_cancel_on_disconnect" not in left  # nothing runs on: the work ran in `task`


async def test_concurrent_requests_share_calls_and_equal_sequential(app, client):
    """Concurrent scoring requests share model calls, and answer as they do alone. An engine
    that batches continuously (vLLM) gets each request as it comes and batches them itself."""
    sequences = [[(7 * i + j) % 250 for j in range(5 + 3 * i)] for i in range(16)]
    alone = []
    for seq in sequences:
        body = (await client.post("/v1/logprobs", json={"tokens": [seq]})).json()
        alone.append(body["outputs"][0]["log_probs"]["full"])
    before = (await client.get("/v1/batching")).json()["models"]["policy"]["score"]
    responses = await asyncio.gather(
        *(client.post("/v1/logprobs", json={"tokens": [seq]}) for seq in sequences)
    )
    after = (await client.get("/v1/batching")).json()["models"]["policy"]["score"]
    for response, expected in zip(responses, alone, strict=True):
        assert_close(response.json()["outputs"][0]["log_probs"]["full"], expected, 1e-5)
    assert after["num_items"] - before["num_items"] == 16
    calls = after["num_calls"] - before["num_calls"]
    if app.state.registry.get("policy").backend.capabilities.continuous_batching:
        assert calls == 16
    else:
        assert calls < 16  # some requests shared a call


async def test_batching_state_route(client, settings):
    body = (await client.get("/v1/batching")).json()
    assert body["enabled"] is True
    assert body["config"]["max_batch_size"] == settings.batching.max_batch_size
    assert set(body["models"]["policy"]) == {"score", "generate"}
    assert body["models"]["policy"]["score"]["queued_items"] == 0


async def test_batching_off_serves_the_same_values(settings, client):
    app = create_app(settings.replace(batching={"enabled": False}))
    async with app.router.lifespan_context(app):
        await started(app)
        async with client_for(app) as direct:
            body = {"tokens": [[1, 2, 3, 4], [5, 6]]}
            off = (await direct.post("/v1/logprobs", json=body)).json()
            state = (await direct.get("/v1/batching")).json()
    on = (await client.post("/v1/logprobs", json=body)).json()
    assert state["enabled"] is False and state["models"] == {}
    for a, b in zip(off["outputs"], on["outputs"], strict=True):
        assert_close(a["log_probs"]["full"], b["log_probs"]["full"], 1e-5)
