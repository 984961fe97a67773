"""Inputs that used to crash a model call or poison stored state are refused with a 422 that
names the field, and no answer carries NaN, Infinity or null where a number belongs."""

from __future__ import annotations

import json

import pytest

GENERATE = {"text": ["hi"], "max_new_tokens": 2}


def strict_json(text: str) -> object:
    """JSON as the spec means it: NaN and Infinity are not numbers."""

    def refuse(constant: str) -> object:
        raise ValueError(f"non-standard JSON number {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 1e-320),
        ("temperature", 0.001),
        ("temperature", 1e300),
        ("repetition_penalty", 1e-300),
        ("repetition_penalty", 1e300),
        ("top_k", 2**63 + 5),
        ("top_p", 1.5),
        ("seed", 2**64),
    ],
)
async def test_sampling_parameters_outside_finite_bounds_are_422(client, field, value):
    refused = await client.post("/v1/generate", json={**GENERATE, field: value})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"] == field
    env = {"dataset": "arithmetic", "max_turns": 1}
    rollout = {"env": env, "num_episodes": 1, "generation": {field: value}}
    refused = await client.post("/v1/rollouts", json=rollout)
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == f"generation.{field}"


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_non_finite_numbers_are_422(client, constant):
    body = f'{{"text": ["hi"], "max_new_tokens": 2, "temperature": {constant}}}'
    refused = await client.post(
        "/v1/generate", content=body, headers={"content-type": "application/json"}
    )
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "temperature"
    kl = (
        '{"prompt_tokens": [[1, 2]], "response_tokens": [[3, 4]], '
        f'"policy_log_probs": [[0, 0, {constant}, -1]]}}'
    )
    refused = await client.post("/v1/kl", content=kl, headers={"content-type": "application/json"})
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "policy_log_probs[0][2]"


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
async def test_kl_of_extreme_log_probs_is_finite_or_422(client, estimator):
    body = {
        "prompt_tokens": [[1, 2]],
        "response_tokens": [[3, 4]],
        "policy_log_probs": [[0.0, 0.0, -1e308, -1e308]],
        "estimator": estimator,
        "rewards": [1e308],
    }
    answer = await client.post("/v1/kl", json=body)
    assert answer.status_code in (200, 422), answer.text
    strict_json(answer.text)
    if answer.status_code == 422:
        assert answer.json()["error"]["param"] in ("policy_log_probs[0]", "rewards[0]")
    huge_coeff = await client.post(
        "/v1/kl",
        json={"prompt_tokens": [[1, 2]], "response_tokens": [[3, 4]], "coeff": 1e308},
    )
    assert huge_coeff.status_code == 422 and huge_coeff.json()["error"]["param"] == "coeff"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/generate", {**GENERATE, "text": ["a\ud800"]}, "text[0]"),
        (
            "/v1/generate",
            {"messages": [[{"role": "user", "content": "\udfff"}]], "max_new_tokens": 2},
            "messages[0][0].content",
        ),
        ("/v1/envs", {"system_prompt": "x\udc00"}, "system_prompt"),
        ("/v1/envs", {"reward": "gsm8k", "reward_options": {"answer_tag": "\ud83d"}}, None),
    ],
)
async def test_lone_surrogates_are_422_and_nothing_is_stored(client, path, body, param):
    before = (await client.get("/v1/envs")).json()["total"]
    # httpx would refuse to encode a lone surrogate; JSON's \\u escape carries it.
    raw = json.dumps(body)
    refused = await client.post(path, content=raw, headers={"content-type": "application/json"})
    assert refused.status_code == 422, refused.text
    if param is not None:
        assert refused.json()["error"]["param"] == param
    assert "surrogate" in refused.json()["error"]["message"]
    listed = await client.get("/v1/envs")
    assert listed.status_code == 200 and listed.json()["total"] == before


async def test_requests_for_unknown_env_ids_leave_nothing_behind(app, client):
    locks = app.state.envs.sessions._locks
    before = len(locks)
    for i in range(200):
        missing = await client.post(f"/v1/envs/env-{i:032x}/step", json={"actions": [None]})
        assert missing.status_code == 404
        assert (await client.post(f"/v1/envs/env-{i:032x}/reset", json={})).status_code == 404
    assert len(locks) == before
