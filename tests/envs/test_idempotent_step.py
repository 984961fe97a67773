"""A step sent again with its idempotency key is answered as it was and applied once, so a
client can retry a step whose answer it lost. Fake model pair."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.fake.backend import FakeBackend, fake_app


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            yield c


async def turns(client: httpx.AsyncClient, env_id: str) -> int:
    state = (await client.get(f"/v1/envs/{env_id}")).json()
    count: int = state["rows"][0]["turns"]
    return count


async def test_a_keyed_step_is_applied_once(client):
    env_id = (await client.post("/v1/envs", json={"kind": "tokens"})).json()["env_id"]
    await client.post(f"/v1/envs/{env_id}/reset", json={"tokens": [[5, 6]]})
    url, body = f"/v1/envs/{env_id}/step", {"actions": [{"tokens": [7, 8]}]}
    first = await client.post(url, json=body, headers={"Idempotency-Key": "step-1"})
    again = await client.post(url, json=body, headers={"Idempotency-Key": "step-1"})
    assert first.status_code == again.status_code == 200
    assert again.json() == first.json()
    assert first.json()["outputs"][0]["observation"]["prompt_tokens"] == [5, 6, 7, 8]
    assert await turns(client, env_id) == 1
    other = await client.post(
        url, json={"actions": [{"tokens": [9]}]}, headers={"Idempotency-Key": "step-1"}
    )
    assert other.status_code == 422 and other.json()["error"]["param"] == "Idempotency-Key"
    assert await turns(client, env_id) == 1
    second = await client.post(url, json=body, headers={"Idempotency-Key": "step-2"})
    assert second.json()["outputs"][0]["observation"]["prompt_tokens"] == [5, 6, 7, 8, 7, 8]
    unkeyed = [await client.post(url, json=body) for _ in range(2)]
    assert all(u.status_code == 200 for u in unkeyed)
    assert await turns(client, env_id) == 4  # without a key every step is a new step
    bad = await client.post(url, json=body, headers={"Idempotency-Key": "has space"})
    assert bad.status_code == 422
