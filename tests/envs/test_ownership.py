"""Sessions belong to the API key that created them: to every other key they are absent (404,
the same answer as for an id that never existed), and listing shows only the caller's own.
Runs on the fake model pair, so no model is loaded."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.fake.backend import FakeBackend, fake_app

KEYS = ["alice-key", "bob-key"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(
        tmp_path,
        *pair,
        auth={"api_keys": KEYS[:1], "admin_api_keys": KEYS[1:]},
        envs={"max_sessions_per_key": 3},
    ) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            yield c


async def create(client: httpx.AsyncClient, key: str) -> str:
    body = {"dataset": "arithmetic", "reward": "none", "max_turns": 2, "batch_size": 1}
    created = await client.post("/v1/envs", json=body, headers=bearer(key))
    assert created.status_code == 201, created.text
    env_id: str = created.json()["env_id"]
    return env_id


async def test_another_keys_session_is_absent_to_every_route(client: httpx.AsyncClient) -> None:
    alice, bob = KEYS  # bob holds the admin key: admin rights are about weights, not sessions
    env_id = await create(client, alice)
    reset = await client.post(f"/v1/envs/{env_id}/reset", json={}, headers=bearer(alice))
    assert reset.is_success
    missing = f"env-{'0' * 32}"
    attempts = [
        ("GET", f"/v1/envs/{env_id}", None),
        ("POST", f"/v1/envs/{env_id}/reset", {}),
        ("POST", f"/v1/envs/{env_id}/step", {"actions": [{"text": "4"}]}),
        ("DELETE", f"/v1/envs/{env_id}", None),
        ("POST", "/v1/rollouts", {"env_id": env_id, "num_episodes": 1}),
    ]
    for method, path, body in attempts:
        theirs = await client.request(method, path, json=body, headers=bearer(bob))
        absent = await client.request(
            method, path.replace(env_id, missing), json=body, headers=bearer(bob)
        )
        assert theirs.status_code == 404, (method, path, theirs.text)
        # Not a different message either: nothing tells bob the id exists.
        assert theirs.json()["error"]["message"] == absent.json()["error"]["message"].replace(
            missing, env_id
        )
    # Nothing bob tried changed alice's session; it is still hers to step and delete.
    state = (await client.get(f"/v1/envs/{env_id}", headers=bearer(alice))).json()
    assert state["rows"][0]["turns"] == 0
    step = {"actions": [{"text": "4"}]}
    stepped = await client.post(f"/v1/envs/{env_id}/step", json=step, headers=bearer(alice))
    assert stepped.status_code == 200, stepped.text
    assert (await client.delete(f"/v1/envs/{env_id}", headers=bearer(alice))).status_code == 204


async def test_listing_shows_only_the_callers_sessions(client: httpx.AsyncClient) -> None:
    alice, bob = KEYS
    mine = {await create(client, alice) for _ in range(2)}
    theirs = {await create(client, bob)}
    for key, expected in ((alice, mine), (bob, theirs)):
        listed = (await client.get("/v1/envs", headers=bearer(key))).json()
        assert {e["env_id"] for e in listed["envs"]} == expected
        assert listed["total"] == len(expected)


async def test_each_key_has_its_own_session_quota(client: httpx.AsyncClient) -> None:
    alice, bob = KEYS
    for _ in range(3):
        await create(client, alice)
    body = {"reward": "none"}
    refused = await client.post("/v1/envs", json=body, headers=bearer(alice))
    assert refused.status_code == 429
    assert "this API key" in refused.json()["error"]["message"]
    assert (await client.post("/v1/envs", json=body, headers=bearer(bob))).status_code == 201


async def test_a_server_rollout_runs_in_sessions_of_the_caller(client: httpx.AsyncClient) -> None:
    alice, bob = KEYS
    env_id = await create(client, alice)
    body = {"env_id": env_id, "num_episodes": 1, "generation": {"max_new_tokens": 2}}
    done = await client.post("/v1/rollouts", json=body, headers=bearer(alice))
    assert done.status_code == 200, done.text
    assert done.json()["trajectories"][0]["env_id"] == env_id
    # Temporary sessions of a rollout are gone afterwards, for their owner too.
    env = {"dataset": "arithmetic", "reward": "none", "max_turns": 1, "batch_size": 1}
    body = {"env": env, "num_episodes": 2, "generation": {"max_new_tokens": 2}}
    assert (await client.post("/v1/rollouts", json=body, headers=bearer(bob))).is_success
    assert (await client.get("/v1/envs", headers=bearer(bob))).json()["total"] == 0


async def test_the_store_keeps_an_owner_digest_never_the_key(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    await create(client, KEYS[0])
    await create(client, KEYS[1])
    with sqlite3.connect(tmp_path / "data" / "sessions.sqlite3") as db:
        owners = [row[0] for row in db.execute("SELECT owner FROM sessions")]
        dump = "\n".join(db.iterdump())
    assert len(set(owners)) == 2 and all(o.startswith("key-") for o in owners)
    assert not any(key in dump for key in KEYS)
