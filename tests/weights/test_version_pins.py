"""Requests that pin the policy version, and the versions every admitted answer reports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.config import Settings
from app.engine.loader import builtin_model_dir
from tests.conftest import served_app

GENERATE = {"tokens": [[5, 6, 7]], "max_new_tokens": 3, "temperature": 0}


async def serve(settings: Settings, tmp_path: Path, **limits) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(storage={"data_dir": tmp_path / "data"}, limits=limits)
    async with served_app(config, timeout=60) as c:
        yield c


@pytest.fixture
async def client(settings: Settings, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async for c in serve(settings, tmp_path):
        yield c


@pytest.fixture(scope="module")
def other_weights(settings: Settings) -> bytes:
    folder = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    return (folder / "model.safetensors").read_bytes()


async def test_every_admitted_answer_reports_its_versions_and_digest(client, other_weights):
    digest = (await client.get("/ready")).json()["digests"]["policy"]
    for path, body in (
        ("/v1/generate", GENERATE),
        ("/v1/logprobs", {"tokens": [[5, 6, 7]]}),
        (
            "/v1/chat/completions",
            {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
    ):
        answer = await client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-policy-version-start"] == "0", path
        assert answer.headers["x-policy-version-end"] == "0", path
        assert answer.headers["x-policy-digest"] == digest, path
    assert (await client.put("/v1/weights", content=other_weights)).status_code == 200
    answer = await client.post("/v1/logprobs", json={"tokens": [[5, 6, 7]]})
    new_digest = (await client.get("/ready")).json()["digests"]["policy"]
    assert new_digest != digest
    assert answer.headers["x-policy-version-start"] == "1"
    assert answer.headers["x-policy-digest"] == new_digest
    metrics = (await client.get("/metrics")).text
    line = f'rlserve_weights_digest_info{{digest="{new_digest}",model="policy",version="1"}} 1.0'
    assert line in metrics
    # Nothing admitted, nothing reported.
    assert "x-policy-version-start" not in (await client.get("/v1/models")).headers


async def test_a_later_pinned_version_is_refused_retryably(client, other_weights):
    refused = await client.post(
        "/v1/generate", json=GENERATE, headers={"X-Min-Policy-Version": "1"}
    )
    assert refused.status_code == 409, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "version_error" and error["param"] == "X-Min-Policy-Version"
    exact = await client.post(
        "/v1/logprobs", json={"tokens": [[5, 6]]}, headers={"X-Policy-Version": "0"}
    )
    assert exact.status_code == 200 and exact.json()["policy_version"] == 0
    assert (await client.put("/v1/weights", content=other_weights)).status_code == 200
    served = await client.post("/v1/generate", json=GENERATE, headers={"X-Min-Policy-Version": "1"})
    assert served.status_code == 200 and served.json()["policy_version"] == 1
    passed = await client.post(
        "/v1/logprobs", json={"tokens": [[5, 6]]}, headers={"X-Policy-Version": "0"}
    )
    assert passed.status_code == 409 and "retry-after" not in passed.headers
    assert passed.json()["error"]["param"] == "X-Policy-Version"


@pytest.mark.parametrize("value", ["-1", "one", "1.5", "99999999999999999"])
async def test_a_pin_that_is_not_a_version_is_refused(client, value):
    answer = await client.post(
        "/v1/generate", json=GENERATE, headers={"X-Min-Policy-Version": value}
    )
    assert answer.status_code == 422
    assert answer.json()["error"]["param"] == "X-Min-Policy-Version"


async def test_a_pinned_request_waits_a_bounded_time_for_its_version(
    settings, tmp_path, other_weights
):
    async for client in serve(settings, tmp_path, version_wait_s=30):
        pinned = asyncio.create_task(
            client.post(
                "/v1/logprobs", json={"tokens": [[5, 6]]}, headers={"X-Min-Policy-Version": "1"}
            )
        )
        await asyncio.sleep(0.3)
        assert not pinned.done()  # waiting for version 1
        assert (await client.put("/v1/weights", content=other_weights)).status_code == 200
        answer = await pinned
        assert answer.status_code == 200, answer.text
        assert answer.json()["policy_version"] == 1
        assert answer.headers["x-policy-version-start"] == "1"


async def test_the_client_pins_its_requests_and_waits_out_a_later_version(
    own_server, other_weights
):
    """`Client.min_policy_version`: a server below it answers 409 with Retry-After; the client
    sends the call again, and it is answered once the version is served."""
    from rlserve_client import ConflictError

    from tests.weights.conftest import loop_client

    app, http = own_server
    trainer = loop_client(app, asyncio.get_running_loop())
    trainer.max_retries = 0
    trainer.min_policy_version = 1
    with pytest.raises(ConflictError, match="X-Min-Policy-Version"):
        await asyncio.to_thread(trainer.logprobs, tokens=[[5, 6, 7]])
    trainer.max_retries = 3
    waiting = asyncio.create_task(asyncio.to_thread(trainer.logprobs, tokens=[[5, 6, 7]]))
    await asyncio.sleep(0.3)  # refused once, its retry due in a second
    assert (await http.put("/v1/weights", content=other_weights)).status_code == 200
    answered = await waiting
    assert answered.policy_version == 1
