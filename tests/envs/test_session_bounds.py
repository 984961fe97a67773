"""A session's cost is bounded: turns default to (and are capped by) the server's limit, and
an action that would push the history past the model's maximum length is refused before any
row changes, a huge text without being encoded at all. Runs on the fake model pair."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.common.inputs import InputPreparer
from tests.fake.backend import FakeBackend, fake_app

MAX_MODEL_LEN = 4096  # the fake backend's


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair, envs={"max_turns": 5}) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            yield c


async def test_max_turns_defaults_to_the_server_limit_and_cannot_exceed_it(client):
    made = await client.post("/v1/envs", json={"kind": "tokens"})
    assert made.status_code == 201 and made.json()["config"]["max_turns"] == 5
    env_id = made.json()["env_id"]
    await client.post(f"/v1/envs/{env_id}/reset", json={"tokens": [[5, 6]]})
    for turn in range(1, 6):
        step = await client.post(f"/v1/envs/{env_id}/step", json={"actions": [{"tokens": [7]}]})
        assert step.json()["outputs"][0]["truncated"] == (turn == 5)
    over = await client.post("/v1/envs", json={"kind": "tokens", "max_turns": 6})
    assert over.status_code == 422 and over.json()["error"]["param"] == "max_turns"


async def test_an_action_past_the_maximum_length_is_refused_and_changes_nothing(
    client, monkeypatch
):
    made = await client.post("/v1/envs", json={"kind": "text", "batch_size": 2})
    env_id = made.json()["env_id"]
    reset = await client.post(f"/v1/envs/{env_id}/reset", json={"query": ["a b", "c d"]})
    before = reset.json()["observations"]
    room = MAX_MODEL_LEN - len(before[1]["prompt_tokens"])
    encoded: list[int] = []
    real_encode = InputPreparer.encode

    def counting(self: InputPreparer, text: str, **kw: bool) -> list[int]:
        encoded.append(len(text))
        return real_encode(self, text, **kw)

    monkeypatch.setattr(InputPreparer, "encode", counting)
    huge = "x " * 500_000  # 1 MB: refused on its length alone
    refused = await client.post(
        f"/v1/envs/{env_id}/step", json={"actions": [{"text": "fine"}, {"text": huge}]}
    )
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "actions[1]"
    assert max(encoded, default=0) < len(huge)
    one_too_many = await client.post(
        f"/v1/envs/{env_id}/step",
        json={"actions": [{"text": "fine"}, {"tokens": [5] * (room + 1)}]},
    )
    assert one_too_many.status_code == 422
    assert one_too_many.json()["error"]["param"] == "actions[1]"
    state = (await client.get(f"/v1/envs/{env_id}")).json()
    assert [r["turns"] for r in state["rows"]] == [0, 0]  # neither row moved
    # Exactly filling the context is allowed, and ends that episode (no room to generate).
    full = await client.post(
        f"/v1/envs/{env_id}/step",
        json={"actions": [{"text": "fine"}, {"tokens": [5] * room}]},
    )
    assert full.status_code == 200, full.text
    first, second = full.json()["outputs"]
    assert len(second["observation"]["prompt_tokens"]) == MAX_MODEL_LEN
    assert second["truncated"] and second["done"]
    assert not first["done"]
