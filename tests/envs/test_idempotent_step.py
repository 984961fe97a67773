"""A step sent again with its idempotency key is answered as it was and applied once, so a
client can retry a step whose answer it lost. Fake model pair."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.envs.engine import RowOutcome, StepResult
from app.envs.episodes import Observation
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


def stored_state(tmp_path: Path, env_id: str) -> dict[str, Any]:
    """The session's state as the store holds it on disk."""
    with sqlite3.connect(tmp_path / "data" / "sessions.sqlite3") as db:
        (text,) = db.execute("SELECT state FROM sessions WHERE env_id = ?", (env_id,)).fetchone()
    state: dict[str, Any] = json.loads(text)
    return state


async def test_a_replayed_chat_step_rebuilds_its_observations_from_the_rows(client, tmp_path):
    """The kept answer leaves the observations out (the rows hold them, and they were half of
    the session); sent again, the step is answered byte for byte as it was, one row done."""
    env_id = (await client.post("/v1/envs", json={"batch_size": 2})).json()["env_id"]
    await client.post(f"/v1/envs/{env_id}/reset", json={"query": ["2 + 2?", "Name a colour"]})
    url = f"/v1/envs/{env_id}/step"
    body = {"actions": [{"text": "4"}, {"text": "blue é"}]}
    await client.post(url, json=body, headers={"Idempotency-Key": "one"})
    kept = stored_state(tmp_path, env_id)["last_step"]
    assert kept["key"] == "one"
    assert all("observation" not in output for output in kept["response"]["outputs"])
    body = {"actions": [{"text": "four"}, {"tokens": [98, 256]}]}
    first = await client.post(url, json=body, headers={"Idempotency-Key": "two"})
    again = await client.post(url, json=body, headers={"Idempotency-Key": "two"})
    assert first.status_code == again.status_code == 200
    assert again.content == first.content
    history = first.json()["outputs"][1]["observation"]["history"]
    assert [m["content"] for m in history[1:]] == ["blue é", "b"]
    unkeyed = await client.post(url, json={"actions": [{"text": "x"}, {"text": "y"}]})
    assert unkeyed.status_code == 200 and stored_state(tmp_path, env_id)["last_step"] is None


def test_a_step_kept_with_its_observations_still_replays() -> None:
    """Answers kept before observations were left out carry them, and they are used."""
    observation = Observation(None, "ab", "ab", [5, 6], None)
    outcome = RowOutcome(observation, 1.0, True, True, False, {"answer": "6"})
    kept = StepResult("env-1", 3, [outcome]).to_json()
    assert StepResult.from_json(kept) == StepResult("env-1", 3, [outcome])
    slim = StepResult("env-1", 3, [outcome]).to_json(observations=False)
    assert "observation" not in slim["outputs"][0]
    assert StepResult.from_json(slim, [observation]) == StepResult("env-1", 3, [outcome])
    with pytest.raises(ValueError, match="without its observation"):
        StepResult.from_json(slim)
