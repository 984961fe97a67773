"""Trajectories recorded by the OpenAI routes: turns joined token-exactly into segments, equal
to /v1/logprobs on the same tokens; a re-templated history that drifts starts a new segment
and says where; rewards; ownership of the id; bad ids."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import assert_close


@pytest.fixture
async def sdk(app) -> AsyncIterator[AsyncOpenAI]:  # type: ignore[no-untyped-def]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlserve")
    async with AsyncOpenAI(base_url="http://rlserve/v1", api_key="-", http_client=http) as client:
        yield client


async def ascii_turn(sdk: AsyncOpenAI, messages: list[dict[str, str]], trajectory: str) -> str:
    """One recorded turn of one token that is printable ASCII (so an agent that sends the
    reply's text back re-templates it to the same token): seeds are tried in order, and only
    the accepted one is recorded (the others are not in the trajectory)."""
    for seed in range(64):
        probe = await sdk.chat.completions.create(
            model="policy", messages=messages, max_tokens=1, seed=seed
        )
        content = probe.choices[0].message.content or ""
        if len(content) == 1 and content.isascii() and content.isprintable():
            reply = await sdk.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=1,
                seed=seed,
                extra_headers={"X-Trajectory-ID": trajectory},
            )
            assert reply.choices[0].message.content == content
            return content
    raise AssertionError("no seed gave a printable ASCII token")


async def test_a_multi_turn_agent_is_one_exact_segment(sdk, client):
    trajectory = uuid.uuid4().hex
    messages = [{"role": "user", "content": "Count with me."}]
    for turn in range(3):
        content = await ascii_turn(sdk, messages, trajectory)
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"and {turn}?"},
        ]
    got = (await client.get(f"/v1/trajectories/{trajectory}")).json()
    assert got["num_turns"] == 3
    (segment,) = got["segments"]
    assert "break_reason" not in segment
    full = segment["tokens"]["full"]
    mask = segment["masks"]["all_assistant_mask"]
    assert sum(mask) == 3 and [t["turn"] for t in segment["turns"]] == [0, 1, 2]
    scored = (await client.post("/v1/logprobs", json={"tokens": [full]})).json()
    reference = scored["outputs"][0]["log_probs"]["full"]
    at = [i for i, m in enumerate(mask) if m]
    assert_close([segment["log_probs"]["full"][i] for i in at], [reference[i] for i in at], 1e-4)
    assert all(segment["log_probs"]["full"][i] == 0.0 for i, m in enumerate(mask) if not m)
    for span in segment["turns"]:
        assert span["policy_versions"] == [[0, span["start"], span["end"]]]


async def test_a_drifting_history_starts_a_new_segment(sdk, client):
    """An agent that sends back an edited reply: the next prompt no longer extends the
    recorded tokens, so the turn starts a segment that says where they differ."""
    trajectory = f"drift-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Hi"}]
    first = await sdk.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=4,
        seed=1,
        extra_body={"trajectory_id": trajectory, "return_token_ids": True},
    )
    assert (first.model_extra or {})["turn"] == 0
    messages += [{"role": "assistant", "content": "edited"}, {"role": "user", "content": "ok"}]
    second = await sdk.chat.completions.create(
        model="policy",
        messages=messages,
        max_tokens=4,
        seed=2,
        extra_body={"trajectory_id": trajectory, "return_token_ids": True},
    )
    assert (second.model_extra or {})["turn"] == 1
    got = (await client.get(f"/v1/trajectories/{trajectory}")).json()
    first_segment, second_segment = got["segments"]
    prompt = (first.model_extra or {})["prompt_token_ids"]
    completion = (first.choices[0].model_extra or {})["token_ids"]
    assert first_segment["tokens"]["full"] == prompt + completion
    assert second_segment["tokens"]["full"] == (
        (second.model_extra or {})["prompt_token_ids"]
        + (second.choices[0].model_extra or {})["token_ids"]
    )
    at = len(prompt)  # the recorded reply begins where "edited" was templated instead
    assert second_segment["break_reason"].endswith(f"differ at token {at}")
    assert first_segment["tokens"]["full"][:at] == second_segment["tokens"]["full"][:at]


async def test_streamed_turns_are_recorded_and_rewards_attach(sdk, client):
    trajectory = uuid.uuid4().hex
    stream = await sdk.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=5,
        seed=4,
        stream=True,
        extra_body={"trajectory_id": trajectory, "return_token_ids": True},
    )
    ids: list[int] = []
    turn = None
    async for chunk in stream:
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
        turn = (chunk.model_extra or {}).get("turn", turn)
    assert turn == 0
    got = (await client.get(f"/v1/trajectories/{trajectory}")).json()
    (segment,) = got["segments"]
    assert segment["tokens"]["full"][-len(ids) :] == ids and len(ids) == 5
    assert "reward" not in got
    response = await client.post(f"/v1/trajectories/{trajectory}/reward", json={"reward": 1.5})
    assert response.status_code == 200
    assert (await client.get(f"/v1/trajectories/{trajectory}")).json()["reward"] == 1.5
    assert (await client.delete(f"/v1/trajectories/{trajectory}")).status_code == 204
    assert (await client.get(f"/v1/trajectories/{trajectory}")).status_code == 404


async def test_unknown_ids_and_bad_ids(client, sdk):
    missing = (await client.get("/v1/trajectories/nope")).json()
    assert missing["error"]["param"] == "trajectory_id"
    response = await client.post("/v1/trajectories/nope/reward", json={"reward": 1})
    assert response.status_code == 404
    response = await client.post("/v1/trajectories/x/reward", json={"reward": "high"})
    assert response.status_code == 422 and response.json()["error"]["param"] == "reward"
    for bad in ("a b", "x" * 200, "a/b"):
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            headers={"X-Trajectory-ID": bad},
        )
        assert response.status_code == 400, bad


async def test_trajectories_belong_to_their_key(tmp_path):
    """To another key a trajectory is absent: it cannot read, reward or delete it, and a
    completion of its naming the same id records a trajectory of its own (ids are per key: no
    key can take an id from another). (On the fake model pair, whose engine streams nothing:
    a stream still ends whole.)"""
    from tests.envs.test_ownership import KEYS, bearer
    from tests.fake.backend import FakeBackend, fake_app

    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    alice, bob = KEYS
    async with fake_app(tmp_path, *pair, auth={"api_keys": KEYS}) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as http:
            body = {
                "model": "policy",
                "messages": [{"role": "user", "content": "Hi"}],
                "trajectory_id": "mine",
            }
            made = await http.post("/v1/chat/completions", json=body, headers=bearer(alice))
            assert made.status_code == 200, made.text
            assert made.json()["choices"][0]["message"]["content"] == "Hi!"  # the fake reply
            attempts = [
                ("GET", "/v1/trajectories/mine", None),
                ("POST", "/v1/trajectories/mine/reward", {"reward": 1.0}),
                ("DELETE", "/v1/trajectories/mine", None),
            ]
            for method, path, payload in attempts:
                theirs = await http.request(method, path, json=payload, headers=bearer(bob))
                assert theirs.status_code == 404, (method, path, theirs.text)
                assert theirs.json()["error"]["param"] == "trajectory_id"
            for _ in range(2):  # bob's own "mine", two turns
                made = await http.post("/v1/chat/completions", json=body, headers=bearer(bob))
                assert made.status_code == 200, made.text
            rewarded = await http.post(
                "/v1/trajectories/mine/reward", json={"reward": 1.0}, headers=bearer(bob)
            )
            assert rewarded.status_code == 200
            bobs = (await http.get("/v1/trajectories/mine", headers=bearer(bob))).json()
            assert (bobs["num_turns"], bobs.get("reward")) == (2, 1.0)
            mine = (await http.get("/v1/trajectories/mine", headers=bearer(alice))).json()
            assert (mine["num_turns"], mine.get("reward")) == (1, None)
            gone = await http.delete("/v1/trajectories/mine", headers=bearer(bob))
            assert gone.status_code == 204
            mine = (await http.get("/v1/trajectories/mine", headers=bearer(alice))).json()
            assert mine["num_turns"] == 1
            streamed = await http.post(
                "/v1/chat/completions", json={**body, "stream": True}, headers=bearer(alice)
            )
            text = "".join(
                chunk["choices"][0]["delta"].get("content", "")
                for line in streamed.text.splitlines()
                if line.startswith("data: {")
                for chunk in [json.loads(line[6:])]
                if chunk["choices"]
            )
            assert text == "Hi!" and streamed.text.rstrip().endswith("data: [DONE]")
            mine = (await http.get("/v1/trajectories/mine", headers=bearer(alice))).json()
            assert mine["num_turns"] == 2


async def test_a_keys_trajectories_are_bounded_in_bytes(tmp_path):
    """Past `trajectories.max_bytes_per_key` a key's next completion naming a trajectory is
    a 429 naming the setting, before it generates; other keys record on; deleting frees the
    room. The store counts the turns' records as stored."""
    from app.ops.auth import owner_of
    from tests.envs.test_ownership import KEYS, bearer
    from tests.fake.backend import FakeBackend, fake_app

    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    alice, bob = KEYS
    bound = {"max_bytes_per_key": 600}
    async with fake_app(tmp_path, *pair, auth={"api_keys": KEYS}, trajectories=bound) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as http:

            async def complete(key: str) -> httpx.Response:
                body = {"model": "policy", "prompt": "x", "trajectory_id": "t"}
                return await http.post("/v1/completions", json=body, headers=bearer(key))

            turns = 0
            while (answer := await complete(alice)).status_code == 200:
                turns += 1
            assert answer.status_code == 429 and turns >= 1, answer.text
            error = answer.json()["error"]
            assert error["param"] == "trajectory_id"
            assert "trajectories.max_bytes_per_key" in error["message"]
            calls = pair[0].calls
            assert (await complete(alice)).status_code == 429
            assert pair[0].calls == calls  # refused before generating
            assert (await complete(bob)).status_code == 200  # not held back by alice's

            store, owner = app.state.trajectories.store, owner_of(alice.encode())
            recorded = await store.get("t", owner)
            assert len(recorded.turns) == turns
            stored = sum(len(json.dumps(dataclasses.asdict(t))) for t in recorded.turns)
            assert await store.usage(owner) == stored >= 600
            deleted = await http.delete("/v1/trajectories/t", headers=bearer(alice))
            assert deleted.status_code == 204 and await store.usage(owner) == 0
            assert (await complete(alice)).status_code == 200


async def test_a_full_trajectory_refuses_more_turns_before_generating(tmp_path):
    from tests.fake.backend import FakeBackend, fake_app

    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair, trajectories={"max_turns": 1}) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as http:
            body = {"model": "policy", "prompt": "x", "trajectory_id": "short"}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            calls = pair[0].calls
            refused = await http.post("/v1/completions", json=body)
            assert (
                refused.status_code == 409 and refused.json()["error"]["param"] == "trajectory_id"
            )
            assert pair[0].calls == calls  # nothing was generated
