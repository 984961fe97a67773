"""Environment sessions over HTTP: TorchRL ChatEnv/LLMEnv behaviour and the error cases."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.engine.loader import builtin_model_dir
from app.envs.hashing import chain_hash, chain_hashes
from app.main import create_app
from tests.conftest import started

SYSTEM = "Answer inside <answer></answer>."


async def create(client: httpx.AsyncClient, **config: object) -> str:
    response = await client.post("/v1/envs", json=config)
    assert response.status_code == 201, response.text
    return str(response.json()["env_id"])


async def call(client: httpx.AsyncClient, path: str, body: object, status: int = 200) -> dict:  # type: ignore[type-arg]
    response = await client.post(path, json=body)
    assert response.status_code == status, response.text
    return response.json()


async def test_chat_reset_and_step_follow_the_chat_template(client, hf_tokenizer):
    env = await create(client, system_prompt=SYSTEM)
    reset = await call(client, f"/v1/envs/{env}/reset", {"query": ["What is 2+3?"]})
    (obs,) = reset["observations"]
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+3?"}]
    assert obs["history"] == history
    expected = hf_tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert obs["prompt_text"] == expected
    assert obs["prompt_tokens"] == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "It is 5."}]})
    (out,) = step["outputs"]
    assert [m["role"] for m in out["observation"]["history"]] == ["system", "user", "assistant"]
    full = [*history, {"role": "assistant", "content": "It is 5."}]
    assert out["observation"]["prompt_text"] == hf_tokenizer.apply_chat_template(
        full, tokenize=False, add_generation_prompt=True
    )
    assert (out["reward"], out["done"], out["terminated"], out["truncated"]) == (
        0.0,
        False,
        False,
        False,
    )
    assert step["policy_version"] == 0


async def test_token_actions_are_decoded_without_special_tokens(client, hf_tokenizer):
    env = await create(client)
    await call(client, f"/v1/envs/{env}/reset", {"query": ["hi"]})
    response = hf_tokenizer("hello", add_special_tokens=False)["input_ids"] + [
        hf_tokenizer.eos_token_id
    ]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": response}]})
    assert step["outputs"][0]["observation"]["history"][-1] == {
        "role": "assistant",
        "content": "hello",
    }


async def test_gsm8k_reward_and_answer_tag_ends_the_episode(client):
    env = await create(client, reward="gsm8k", batch_size=3)
    await call(
        client,
        f"/v1/envs/{env}/reset",
        {"query": ["q1", "q2", "q3"], "answer": ["#### 1,000", "#### 7", "#### 3"]},
    )
    actions = [
        {"text": "<answer>1000.00</answer>"},
        {"text": "<answer>8</answer>"},
        {"text": "thinking"},
    ]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": actions})
    rewards = [o["reward"] for o in step["outputs"]]
    assert rewards == [1.0, 0.1, 0.0]
    assert [o["terminated"] for o in step["outputs"]] == [True, True, False]
    assert step["outputs"][0]["info"]["answer"] == "#### 1,000"
    assert step["outputs"][0]["info"]["reward"]["correct"] is True
    # finished rows take null; an action for one is a conflict
    await call(client, f"/v1/envs/{env}/step", {"actions": [None, None, {"text": "more"}]})
    conflict = await client.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": "again"}, None, {"text": "x"}]}
    )
    assert conflict.status_code == 409
    assert conflict.json()["error"]["param"] == "actions[0]"


async def test_dataset_rows_and_repeats(client):
    env = await create(
        client, dataset="arithmetic", batch_size=4, repeats=2, seed=7, reward="gsm8k"
    )
    first = await call(client, f"/v1/envs/{env}/reset", {})
    queries = [o["history"][-1]["content"] for o in first["observations"]]
    assert queries[0] == queries[1] and queries[2] == queries[3] and queries[0] != queries[2]
    second = await call(client, f"/v1/envs/{env}/reset", {})
    assert second["observations"][0]["history"][-1]["content"] not in queries
    # The same seed draws the same prompts in another session.
    other = await create(client, dataset="arithmetic", batch_size=4, repeats=2, seed=7)
    again = await call(client, f"/v1/envs/{other}/reset", {})
    assert [o["history"][-1]["content"] for o in again["observations"]] == queries


async def test_truncation_at_max_turns(client):
    env = await create(client, max_turns=2)
    await call(client, f"/v1/envs/{env}/reset", {"query": ["go"]})
    one = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "a"}]})
    assert one["outputs"][0]["done"] is False
    two = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "b"}]})
    assert (two["outputs"][0]["truncated"], two["outputs"][0]["terminated"]) == (True, False)
    assert two["outputs"][0]["done"] is True
    await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "c"}]}, status=409)
    state = (await client.get(f"/v1/envs/{env}")).json()
    assert state["rows"] == [
        {"turns": 2, "done": True, "terminated": False, "truncated": True, "total_reward": 0.0}
    ]


async def test_text_and_token_environments_append_actions(client, hf_tokenizer):
    env = await create(client, kind="text")
    reset = await call(client, f"/v1/envs/{env}/reset", {"query": ["Once"]})
    assert reset["observations"][0]["text"] == "Once"
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": " upon"}]})
    assert step["outputs"][0]["observation"]["prompt_text"] == "Once upon"
    env = await create(client, kind="tokens", hashing=True)
    reset = await call(client, f"/v1/envs/{env}/reset", {"tokens": [[1, 2, 3]]})
    assert reset["observations"][0]["hash"] == chain_hash([1, 2, 3])
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": [4, 5]}]})
    obs = step["outputs"][0]["observation"]
    assert obs["prompt_tokens"] == [1, 2, 3, 4, 5]
    assert obs["hash"] == chain_hash([1, 2, 3, 4, 5])
    assert chain_hashes([1, 2, 3, 4, 5])[2] == reset["observations"][0]["hash"]


async def test_tool_timeout_does_not_stall_the_server(client):
    env = await create(client, tools=["python"])
    await call(client, f"/v1/envs/{env}/reset", {"query": ["loop"]})
    stuck = asyncio.create_task(
        client.post(
            f"/v1/envs/{env}/step", json={"actions": [{"text": "```python\nwhile True: pass\n```"}]}
        )
    )
    await asyncio.sleep(0.2)
    health = await client.get("/health")  # answered while the tool runs
    assert health.status_code == 200 and not stuck.done()
    result = await stuck
    assert "failed" in result.json()["outputs"][0]["observation"]["history"][-1]["content"]


async def test_kl_penalty_against_the_frozen_reference_is_zero(client):
    env = await create(client, kl={"coeff": 0.5, "estimator": "k3"}, reward="gsm8k")
    await call(client, f"/v1/envs/{env}/reset", {"query": ["q"], "answer": ["#### 1"]})
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "<answer>1</answer>"}]})
    out = step["outputs"][0]
    # Zero up to float noise: the two forwards may run at once and split their matmuls
    # differently over the CPU threads (2e-6 seen), so they are not always bit-equal.
    assert abs(out["info"]["reward"]["kl"]) < 1e-4
    assert out["reward"] == pytest.approx(1.0, abs=1e-4)


async def test_errors(client):
    assert (await client.post("/v1/envs/env-nope/reset", json={})).status_code == 404
    assert (await client.get("/v1/envs/env-nope")).status_code == 404
    env = await create(client, batch_size=2)
    early = await client.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": "a"}, {"text": "b"}]}
    )
    assert early.status_code == 409
    await call(client, f"/v1/envs/{env}/reset", {"query": ["a", "b"]})
    wrong = await client.post(f"/v1/envs/{env}/step", json={"actions": [{"text": "a"}]})
    assert wrong.status_code == 422
    assert wrong.json()["error"]["param"] == "actions"
    assert "1 entries for batch_size 2" in wrong.json()["error"]["message"]
    missing = await client.post(f"/v1/envs/{env}/step", json={"actions": [{"text": "a"}, None]})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "actions[1]"
    bad = await client.post(f"/v1/envs/{env}/reset", json={"query": ["only one"]})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "query"
    for config, param in (
        ({"reward": "nope"}, "reward"),
        ({"dataset": "nope"}, "dataset"),
        ({"batch_size": 3, "repeats": 2}, "repeats"),
        ({"tools": ["bash"]}, "tools[0]"),
    ):
        response = await client.post("/v1/envs", json=config)
        assert response.status_code == 422, config
        assert response.json()["error"]["param"] == param
    no_dataset = await create(client)
    response = await client.post(f"/v1/envs/{no_dataset}/reset", json={})
    assert response.status_code == 409 and response.json()["error"]["param"] == "query"
    assert (await client.delete(f"/v1/envs/{env}")).status_code == 204
    assert (await client.get(f"/v1/envs/{env}")).status_code == 404


async def test_listing_is_paged(client):
    ids = [await create(client) for _ in range(3)]
    listed = (await client.get("/v1/envs", params={"offset": 0, "limit": 500})).json()
    assert set(ids) <= {e["env_id"] for e in listed["envs"]}
    page = (await client.get("/v1/envs", params={"offset": 1, "limit": 2})).json()
    assert len(page["envs"]) == 2 and page["total"] == listed["total"]


@pytest.fixture
async def short_lived(settings: Settings, tmp_path) -> AsyncIterator[FastAPI]:  # type: ignore[no-untyped-def]
    app = create_app(
        settings.replace(
            storage={"data_dir": tmp_path},
            envs={"ttl_s": 0.5, "max_sessions": 2},
            models={"load_reference": False},
        )
    )
    async with app.router.lifespan_context(app):
        await started(app)
        yield app


async def test_ttl_expiry_and_session_cap(short_lived):
    transport = httpx.ASGITransport(app=short_lived)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        first = await create(client)
        await create(client)
        full = await client.post("/v1/envs", json={})
        assert full.status_code == 429
        assert full.json()["error"]["type"] == "rate_limit_error"
        await asyncio.sleep(0.7)
        assert (await client.get(f"/v1/envs/{first}")).status_code == 404
        # The other one, never read again, is reaped: here, or already by the server's own
        # reaper (it runs every second, and a loaded machine can take that long to get here).
        await short_lived.state.envs.reap()
        assert await short_lived.state.envs.sessions.count() == 0
        await create(client)  # room again


async def test_a_running_tool_does_not_hold_up_a_weight_update(settings, tmp_path):
    app = create_app(settings.replace(storage={"data_dir": tmp_path}, tools={"timeout_s": 3.0}))
    payload = (
        builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models) / "model.safetensors"
    ).read_bytes()
    async with app.router.lifespan_context(app):
        await started(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            env = await create(client, tools=["python"])
            await call(client, f"/v1/envs/{env}/reset", {"query": ["loop"]})
            action = {"text": "```python\nwhile True: pass\n```"}
            step = asyncio.create_task(
                client.post(f"/v1/envs/{env}/step", json={"actions": [action]})
            )
            await asyncio.sleep(0.3)
            update = await client.put("/v1/weights", content=payload)
            assert update.status_code == 200
            assert not step.done()  # the update finished while the tool was still running
            assert (await step).status_code == 200
