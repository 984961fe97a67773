"""/v1/kl against independent forwards of two different models, and its rules."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.conftest import forward_log_probs

CONVERSATION = [
    {"role": "user", "content": "What is 6*7?"},
    {"role": "assistant", "content": "42, I think."},
]
FORMULAS = {
    "k1": lambda d: d,
    "abs": lambda d: abs(d),
    "k2": lambda d: d * d / 2,
    "k3": lambda d: math.exp(-d) + d - 1,
}


async def kl(client: httpx.AsyncClient, **body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post("/v1/kl", json=body)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
async def test_estimators_against_independent_forwards(
    two_model_client, hf_model, ref_model, hf_tokenizer, estimator
):
    body = await kl(two_model_client, messages=[CONVERSATION], estimator=estimator)
    (out,) = body["outputs"]
    ids = out["tokens"]["full"]
    expected_ids = list(hf_tokenizer.apply_chat_template(CONVERSATION)["input_ids"])
    assert ids == expected_ids
    p, q = forward_log_probs(hf_model, ids), forward_log_probs(ref_model, ids)
    mask = list(
        hf_tokenizer.apply_chat_template(CONVERSATION, return_assistant_tokens_mask=True)[
            "assistant_masks"
        ]
    )
    assert out["mask"] == mask
    # The returned log-probs equal the independent forwards...
    assert (
        max(
            abs(a - (b if m else 0.0))
            for a, b, m in zip(out["ref_log_probs"], q, mask, strict=True)
        )
        < 1e-5
    )
    assert (
        max(
            abs(a - (b if m else 0.0))
            for a, b, m in zip(out["policy_log_probs"], p, mask, strict=True)
        )
        < 1e-5
    )
    # ...and every per-token KL is the estimator's formula of them.
    returned = zip(out["policy_log_probs"], out["ref_log_probs"], mask, strict=True)
    expected = [FORMULAS[estimator](a - b) if m else 0.0 for a, b, m in returned]
    assert max(abs(a - b) for a, b in zip(out["kl"], expected, strict=True)) < 1e-5
    assert all(v == 0.0 for v, m in zip(out["kl"], mask, strict=True) if not m)
    independent = [
        FORMULAS[estimator](a - b) if m else 0.0 for a, b, m in zip(p, q, mask, strict=True)
    ]
    assert out["kl"] == pytest.approx(independent, rel=1e-4, abs=1e-5)
    assert out["num_counted"] == sum(mask)
    assert out["kl_sum"] == pytest.approx(sum(out["kl"]), abs=1e-9)
    assert out["kl_sum"] == pytest.approx(sum(expected), abs=1e-4)
    assert out["kl_mean"] == pytest.approx(out["kl_sum"] / sum(mask), abs=1e-9)
    if estimator != "k1":
        assert all(v >= 0 for v in out["kl"])


async def test_split_counts_response_tokens_and_all_tokens_when_asked(
    two_model_client, hf_model, ref_model
):
    body = await kl(two_model_client, prompt_tokens=[[5, 6, 7]], response_tokens=[[8, 9]])
    assert body["outputs"][0]["mask"] == [0, 0, 0, 1, 1]
    ids = [1, 2, 3, 4, 5, 6]
    body = await kl(two_model_client, tokens=[ids], assistant_only=False)
    out = body["outputs"][0]
    assert out["mask"] == [0, 1, 1, 1, 1, 1]
    p, q = forward_log_probs(hf_model, ids), forward_log_probs(ref_model, ids)
    assert max(abs(k - (a - b)) for k, a, b in zip(out["kl"][1:], p[1:], q[1:], strict=True)) < 1e-5


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
async def test_kl_is_exactly_zero_against_the_frozen_copy(client, estimator):
    sequences = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
    body = await kl(client, tokens=sequences, estimator=estimator, assistant_only=False)
    for seq, out in zip(sequences, body["outputs"], strict=True):
        assert out["kl"] == [0.0] * len(seq)
        assert out["kl_sum"] == 0.0 and out["kl_mean"] == 0.0
        assert out["policy_log_probs"] == out["ref_log_probs"]
    body = await kl(client, messages=[CONVERSATION], estimator=estimator)
    assert set(body["outputs"][0]["kl"]) == {0.0}


async def test_client_policy_log_probs_are_used_as_given(client):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    reference = (
        await client.post("/v1/logprobs", json={"tokens": [ids], "model": "reference"})
    ).json()
    q = reference["outputs"][0]["log_probs"]["full"]
    altered = [v - 0.25 * t for t, v in enumerate(q)]
    body = await kl(client, tokens=[ids], policy_log_probs=[altered], assistant_only=False)
    out = body["outputs"][0]
    assert out["policy_log_probs"] == [0.0, *altered[1:]]
    assert out["kl"] == pytest.approx([0.0] + [-0.25 * t for t in range(1, len(ids))], abs=1e-6)


async def test_reward_placements_by_hand(client):
    ids = [10, 11, 12, 13, 14]
    q = (await client.post("/v1/logprobs", json={"tokens": [ids], "model": "reference"})).json()
    q = q["outputs"][0]["log_probs"]["full"]
    p = [a + d for a, d in zip(q, [0.0, 0.0, 0.1, -0.2, 0.3], strict=True)]
    common = {"prompt_tokens": [ids[:2]], "response_tokens": [ids[2:]], "policy_log_probs": [p]}
    common |= {"rewards": [1.0], "coeff": 0.5}
    last = (await kl(client, **common))["outputs"][0]
    broadcast = (await kl(client, **common, reward_placement="broadcast"))["outputs"][0]
    kl_t = [0.0, 0.0, 0.1, -0.2, 0.3]
    assert last["shaped_rewards"] == pytest.approx([0.0, 0.0, -0.05, 0.1, 1.0 - 0.15], abs=1e-6)
    assert broadcast["shaped_rewards"] == pytest.approx(
        [0.0, 0.0, 1.0 - 0.05, 1.0 + 0.1, 1.0 - 0.15], abs=1e-6
    )
    assert last["kl"] == pytest.approx(kl_t, abs=1e-6)
    assert (
        "shaped_rewards" not in (await kl(client, tokens=[ids], assistant_only=False))["outputs"][0]
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tokens": [[1, 2, 3]]}, "assistant_only", "split"),
        ({"text": ["abc"]}, "assistant_only", "split"),
        (
            {
                "tokens": [[1, 2], [3, 4, 5]],
                "assistant_only": False,
                "policy_log_probs": [[0.0, 0.0], [0.0]],
            },
            "policy_log_probs[1]",
            "has 1 values but sequence 1 has 3 tokens",
        ),
        (
            {"tokens": [[1, 2]], "assistant_only": False, "policy_log_probs": [[0.0, 0.0], [0.0]]},
            "policy_log_probs",
            "2 entries for 1 sequences",
        ),
        (
            {"tokens": [[1, 2]], "assistant_only": False, "rewards": [1.0, 2.0]},
            "rewards",
            "2 entries",
        ),
        ({"tokens": [[1, 2]], "assistant_only": False, "estimator": "k4"}, "estimator", "k1"),
        ({"tokens": [[1, 2]], "assistant_only": False, "coeff": -1}, "coeff", "greater"),
        (
            {"tokens": [[1, 2]], "assistant_only": False, "reward_placement": "first"},
            "reward_placement",
            "last_token",
        ),
    ],
)
async def test_invalid_kl_requests(client, body, param, words):
    response = await client.post("/v1/kl", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


async def test_models_lists_policy_and_reference(client):
    names = [m["name"] for m in (await client.get("/v1/models")).json()["models"]]
    assert names == ["policy", "reference"]
