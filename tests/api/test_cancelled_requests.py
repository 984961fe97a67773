"""A request cancelled before its answer, at the ASGI level (as uvicorn runs it): at the end
of the shutdown grace its client gets a retryable 503 in the error shape; after its client
went away nothing is sent and it is counted as 499, not as a server error."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI

from tests.asgi import Connection

# Seconds of decoding (32 rows of 512 tokens: the test server's limits).
BODY = json.dumps({"tokens": [[1, 2, 3]] * 32, "max_tokens": 512, "ignore_eos": True}).encode()


def counted(app: FastAPI, status: str) -> float:
    """rlserve_requests_total for /v1/generate with `status`, as /metrics reports it."""
    labels = {"route": "/v1/generate", "method": "POST", "status": status}
    value = app.state.metrics.registry.get_sample_value("rlserve_requests_total", labels)
    return float(value or 0.0)


async def generating(app: FastAPI, connection: Connection) -> asyncio.Task[None]:
    queued = app.state.registry.get("policy").generation
    task = asyncio.create_task(connection.post(app, "/v1/generate"))
    for _ in range(2000):  # until its decoding has started
        if queued.stats().in_flight_calls:
            return task
        await asyncio.sleep(0.005)
    raise AssertionError("the generation did not start")


async def test_cancelled_while_its_client_waits_is_a_retryable_503(app: FastAPI):
    before = counted(app, "503")
    connection = Connection(BODY)
    task = await generating(app, connection)
    task.cancel()  # what uvicorn does when the shutdown grace is over
    with pytest.raises(asyncio.CancelledError):
        await task
    start, body = connection.messages
    assert start["status"] == 503
    headers = dict(start["headers"])
    assert headers[b"retry-after"] == b"1" and headers[b"x-request-id"]
    error = json.loads(body["body"])["error"]
    assert error["type"] == "unavailable_error" and error["code"] == 503
    assert "shutting down" in error["message"]
    assert counted(app, "503") == before + 1
    await idle(app)


async def test_a_client_that_went_away_is_counted_as_499(app: FastAPI):
    before = {status: counted(app, status) for status in ("499", "500")}
    connection = Connection(BODY)
    task = await generating(app, connection)
    connection.leave.set()
    # The request ends quietly (a crash would reach the server, which logs it at ERROR).
    assert await asyncio.wait_for(task, timeout=60) is None
    assert connection.messages == []  # nobody to answer
    assert counted(app, "499") == before["499"] + 1
    assert counted(app, "500") == before["500"]
    await idle(app)


async def idle(app: FastAPI) -> None:
    """The cancelled generation stopped: the engine is free again within moments, not once
    its 512 tokens are decoded."""
    queued = app.state.registry.get("policy").generation
    for _ in range(400):
        if not queued.stats().in_flight_calls:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the cancelled generation kept running")
