"""rlserve's own `/v1/generate` and `/v1/rollouts` take every sampling parameter its dialects
take (min-p, min-tokens, stop ids, penalties, logit bias, allowed tokens, bad words), through
the one resolver: checked against a greedy decoder written here over a plain forward, against
the vLLM dialect's answer for the same seed, and refused by each route's own field names;
template variables only with a conversation."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.dialects.test_sampling_surface import PROMPT, greedy


async def generate(client: httpx.AsyncClient, **body: object) -> dict:  # type: ignore[type-arg]
    answer = await client.post("/v1/generate", json={"tokens": [PROMPT], **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["outputs"][0][0]  # type: ignore[no-any-return]


async def test_penalties_bias_and_allowed_tokens_shape_greedy_generation(client, hf_model):
    plain = await generate(client, max_new_tokens=10, temperature=0, ignore_eos=True)
    tokens = plain["tokens"]["response"]
    favoured = tokens[1]
    allowed = sorted({*tokens[:6], favoured, 50, 51})
    params = {
        "frequency_penalty": 1.5,
        "presence_penalty": 0.5,
        "logit_bias": {str(favoured): 2.5},
        "allowed_token_ids": allowed,
    }

    def process(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        logits[favoured] += 2.5
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
        logits = logits - 1.5 * counts - 0.5 * (counts > 0).float()
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    got = await generate(client, max_new_tokens=10, temperature=0, ignore_eos=True, **params)
    want = greedy(hf_model, PROMPT, 10, process)
    assert got["tokens"]["response"] == want
    assert want != tokens  # the parameters changed something
    # The log-probs are the raw model's, whatever shaped the choice.
    raw = forward_log_probs(hf_model, PROMPT + want)[len(PROMPT) :]
    assert_close(got["log_probs"]["response"], raw, 1e-4)


async def test_stop_ids_end_generation_after_min_tokens(client, hf_model):
    plain = await generate(client, max_new_tokens=8, temperature=0, ignore_eos=True)
    tokens = plain["tokens"]["response"]
    stop = tokens[2]
    first = tokens.index(stop)
    got = await generate(
        client, max_new_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop]
    )
    assert got["tokens"]["response"] == tokens[: first + 1]
    assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
    # Until min_tokens are generated the stop id cannot be sampled (as vLLM masks it).
    least = first + 2

    def masked(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        if len(out) < least:
            logits[stop] = float("-inf")
        return logits

    held = await generate(
        client,
        max_new_tokens=8,
        temperature=0,
        ignore_eos=True,
        stop_token_ids=[stop],
        min_tokens=least,
    )
    want = greedy(hf_model, PROMPT, 8, masked, stop=lambda token, out: token == stop)
    assert held["tokens"]["response"] == want
    assert stop not in want[:least]


async def test_sampled_rows_match_the_vllm_dialect_for_the_same_seed(client):
    """/v1/generate and /inference/v1/generate resolve the same parameters into the same
    sampling, so one seed gives the same tokens on both."""
    params = {
        "temperature": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.4,
        "logit_bias": {"50": 1.0},
        "min_tokens": 3,
        "bad_words": ["a"],
        "seed": 5,
    }
    own = await generate(client, max_new_tokens=12, **params)
    body = {
        "token_ids": PROMPT,
        "sampling_params": {**params, "max_tokens": 12, "logit_bias": {50: 1.0}},
    }
    answer = await client.post("/inference/v1/generate", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == own["tokens"]["response"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {"999999": 1.0}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"min_tokens": 9, "max_new_tokens": 4}, "min_tokens"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"max_tokens": 1 << 30}, "max_tokens"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
async def test_refusals_name_the_generate_routes_field(client, body, param):
    answer = await client.post("/v1/generate", json={"tokens": [PROMPT], **body})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == param


async def test_rollouts_take_the_same_parameters_under_generation(client):
    env = {"dataset": "arithmetic", "reward": "number", "batch_size": 2, "max_turns": 1}
    allowed = [50, 51, 52]
    generation = {"max_new_tokens": 5, "seed": 3, "allowed_token_ids": allowed}
    answer = await client.post(
        "/v1/rollouts", json={"env": env, "num_episodes": 2, "generation": generation}
    )
    assert answer.status_code == 200, answer.text
    for trajectory in answer.json()["trajectories"]:
        for step in trajectory["steps"]:
            assert set(step["tokens"]["response"]) <= set(allowed)
    refused = {**generation, "logit_bias": {"999999": 1.0}}
    answer = await client.post(
        "/v1/rollouts", json={"env": env, "num_episodes": 2, "generation": refused}
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "generation.logit_bias"


@pytest.mark.parametrize("route", ["/v1/generate", "/v1/logprobs"])
async def test_template_variables_need_a_conversation(client, route):
    body = {"tokens": [PROMPT], "chat_template_kwargs": {"enable_thinking": False}}
    answer = await client.post(route, json=body)
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["param"] == "chat_template_kwargs"


async def test_a_dialects_ignored_keys_never_reach_the_sampling(client):
    """vLLM's sampling_params take unknown keys and ignore them (trainers pass their own
    configs through): one named as an rlserve parameter changes nothing."""
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "seed": 3}}
    plain = await client.post("/inference/v1/generate", json=body)
    body["sampling_params"] |= {"do_sample": False, "return_routed_experts": True}
    extra = await client.post("/inference/v1/generate", json=body)
    assert plain.status_code == extra.status_code == 200, extra.text
    tokens = [r.json()["choices"][0]["token_ids"] for r in (plain, extra)]
    assert tokens[0] == tokens[1]
