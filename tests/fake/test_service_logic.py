"""Service logic against a fake model pair whose log-probs are chosen: the env KL penalty's
sign and size, its equality with /v1/kl, and per-step policy versions across a weight update
in the middle of a rollout. No model is loaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.fake.backend import FakeBackend, fake_app

COEFF = 0.5


def policy_log_prob(token: int) -> float:
    return -0.1 * (token % 5) - 0.1


def reference_log_prob(token: int) -> float:
    return -0.3


async def post(client: httpx.AsyncClient, path: str, body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post(path, json=body)
    assert response.status_code in (200, 201), response.text
    return response.json()


@pytest.fixture
async def client(tmp_path: Path):  # type: ignore[no-untyped-def]
    pair = FakeBackend("policy", policy_log_prob), FakeBackend("reference", reference_log_prob)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            yield c


@pytest.mark.parametrize(
    "action",
    [
        [72, 105, 33],  # KL +0.1: policy above the reference on "i", below on "!"
        [33, 33],  # KL -0.2: the policy below the reference on every token
        [70, 75],  # KL 0.4
    ],
)
async def test_env_kl_penalty_sign_and_size(client, action):
    expected_kl = sum(policy_log_prob(t) - reference_log_prob(t) for t in action)
    env = await post(client, "/v1/envs", {"reward": "none", "kl": {"coeff": COEFF}, "max_turns": 1})
    env_id = env["env_id"]
    reset = await post(client, f"/v1/envs/{env_id}/reset", {"query": ["q"]})
    prompt = reset["observations"][0]["prompt_tokens"]
    step = await post(client, f"/v1/envs/{env_id}/step", {"actions": [{"tokens": action}]})
    out = step["outputs"][0]
    # only the action's tokens count, not the end-of-turn the template adds after them
    assert out["info"]["reward"]["kl"] == pytest.approx(expected_kl, abs=1e-9)
    assert out["reward"] == pytest.approx(-COEFF * expected_kl, abs=1e-9)
    kl = await post(client, "/v1/kl", {"prompt_tokens": [prompt], "response_tokens": [action]})
    assert kl["outputs"][0]["kl_sum"] == pytest.approx(expected_kl, abs=1e-9)


async def test_policy_version_per_step_across_a_weight_update(tmp_path: Path):
    """A weight update lands between the first and the second turn of a rollout: the first
    step was generated on version 0, the second on version 1."""
    updates: list[asyncio.Task[None]] = []
    policy = FakeBackend("policy", policy_log_prob)
    async with fake_app(tmp_path, policy, FakeBackend("reference", reference_log_prob)) as app:
        registry = app.state.registry

        async def update() -> None:
            async with registry.writing("policy"):
                pass

        def on_generate(call: int) -> None:
            if call == 0:  # waits for this generation's read lease, then commits
                updates.append(asyncio.create_task(update()))

        policy.on_generate = on_generate
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            env = {"dataset": "arithmetic", "reward": "none", "max_turns": 3, "batch_size": 1}
            body = {"env": env, "num_episodes": 1, "generation": {"max_new_tokens": 3}}
            out = await post(client, "/v1/rollouts", body)
        await asyncio.gather(*updates)
    (trajectory,) = out["trajectories"]
    assert [s["policy_version"] for s in trajectory["steps"]] == [0, 1, 1]
    assert out["policy_version"] == 1
    for step in trajectory["steps"]:
        response = step["tokens"]["response"]
        assert response == [72, 105, 33]
        assert step["log_probs"]["response"] == [policy_log_prob(t) for t in response]


async def test_a_recorded_turn_keeps_the_finish_reason_of_its_reply(tmp_path: Path):
    """A chat reply that calls a tool finishes with "tool_calls", in the reply and in the
    recorded trajectory's turn (which kept the generation's "stop")."""
    from app.engine.builtin_model import build_tokenizer

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    reply = build_tokenizer().encode(call, add_special_tokens=False)
    pair = (
        FakeBackend("policy", policy_log_prob, reply=reply),
        FakeBackend("reference", reference_log_prob),
    )
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            body = {
                "messages": [{"role": "user", "content": "1 + 2?"}],
                "tools": [tool],
                "max_tokens": len(reply) + 5,
            }
            response = await client.post(
                "/v1/chat/completions", json=body, headers={"X-Trajectory-ID": "t-1"}
            )
            assert response.status_code == 200, response.text
            (choice,) = response.json()["choices"]
            assert choice["finish_reason"] == "tool_calls"
            assert choice["message"]["tool_calls"][0]["function"]["name"] == "add"
            # a reply of tool calls alone has no text: its content is null, sent as vLLM does
            assert "content" in choice["message"] and choice["message"]["content"] is None
            recorded = (await client.get("/v1/trajectories/t-1")).json()
            (segment,) = recorded["segments"]
            assert [turn["finish_reason"] for turn in segment["turns"]] == ["tool_calls"]
