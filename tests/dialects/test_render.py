"""vLLM's render and derender routes: a rendered chat or completion request, sent to
`/inference/v1/generate`, samples what `/v1/chat/completions` and `/v1/completions` sample for
the same seed, and derendering that answer gives back their reply, field for field."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import assert_close

MESSAGES = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 2 + 3?"},
]


async def ok(response: httpx.Response) -> dict:  # type: ignore[type-arg]
    assert response.status_code == 200, response.text
    return response.json()


def without_ids(reply: dict) -> dict:  # type: ignore[type-arg]
    """A reply less what differs between two calls: its id and creation time."""
    return {k: v for k, v in reply.items() if k not in ("id", "created")}


@pytest.mark.parametrize("logprobs", [False, True])
async def test_a_rendered_chat_samples_and_derenders_as_the_chat_route(client, logprobs):
    chat = {
        "model": "policy",
        "messages": MESSAGES,
        "max_tokens": 8,
        "seed": 11,
        "n": 2,
        "temperature": 0.9,
        "stop": ["\n\n"],
        "logprobs": logprobs,
        "top_logprobs": 2 if logprobs else None,
        "return_token_ids": True,
    }
    expected = await ok(await client.post("/v1/chat/completions", json=chat))
    rendered = await ok(await client.post("/v1/chat/completions/render", json=chat))
    assert rendered["token_ids"] == expected["prompt_token_ids"]
    assert rendered["model"] == "policy" and rendered["stream"] is False
    params = rendered["sampling_params"]
    assert (params["n"], params["seed"], params["max_tokens"], params["stop"]) == (
        2,
        11,
        8,
        ["\n\n"],
    )
    assert params["logprobs"] == (2 if logprobs else None)
    generated = await ok(await client.post("/inference/v1/generate", json=rendered))
    sampled = [c["token_ids"] for c in generated["choices"]]
    assert sampled == [c["token_ids"] for c in expected["choices"]]
    body = {"generate_response": generated, "chat_request": chat}
    derendered = await ok(await client.post("/v1/chat/completions/derender", json=body))
    assert derendered["id"].startswith("chatcmpl-")
    mine, theirs = without_ids(derendered), without_ids(expected)
    if logprobs:  # log-probs equal within the engine's noise; the rest exactly
        for a, b in zip(mine.pop("choices"), theirs.pop("choices"), strict=True):
            got, want = a.pop("logprobs")["content"], b.pop("logprobs")["content"]
            assert [e["token"] for e in got] == [e["token"] for e in want]
            assert_close([e["logprob"] for e in got], [e["logprob"] for e in want], 1e-5)
            assert a == b
    assert mine == theirs


async def test_top_p_zero_renders_as_top_k_one_and_samples_the_same(client):
    """OpenAI's top_p 0 (the most likely token alone) is outside vLLM's (0, 1]: it renders as
    top_k 1, which draws the same tokens (it was a 500)."""
    chat = {"messages": MESSAGES, "max_tokens": 6, "seed": 4, "top_p": 0, "return_token_ids": True}
    expected = await ok(await client.post("/v1/chat/completions", json=chat))
    rendered = await ok(await client.post("/v1/chat/completions/render", json=chat))
    assert (rendered["sampling_params"]["top_p"], rendered["sampling_params"]["top_k"]) == (1.0, 1)
    generated = await ok(await client.post("/inference/v1/generate", json=rendered))
    assert generated["choices"][0]["token_ids"] == expected["choices"][0]["token_ids"]


async def test_rendered_completions_sample_and_derender_as_the_completions_route(client):
    """One body per prompt, each sampled as a request of its own (with a seed, as
    `/v1/completions` samples that prompt alone: vLLM gives each prompt the request's seed)."""
    request = {
        "model": "policy",
        "prompt": ["Once upon", "The sky is"],
        "max_tokens": 6,
        "seed": 5,
        "logprobs": 1,
        "return_token_ids": True,
    }
    alone = [
        await ok(await client.post("/v1/completions", json={**request, "prompt": p}))
        for p in request["prompt"]
    ]
    expected = [reply["choices"][0] for reply in alone]
    rendered = await ok(await client.post("/v1/completions/render", json=request))
    assert len(rendered) == 2 and rendered[0]["request_id"] != rendered[1]["request_id"]
    assert [r["token_ids"] for r in rendered] == [c["prompt_token_ids"] for c in expected]
    answers = [await ok(await client.post("/inference/v1/generate", json=r)) for r in rendered]
    assert [a["choices"][0]["token_ids"] for a in answers] == [c["token_ids"] for c in expected]
    body = {"generate_responses": answers, "completion_request": request}
    derendered = await ok(await client.post("/v1/completions/derender", json=body))
    assert [c["index"] for c in derendered["choices"]] == [0, 1]
    for got, want in zip(derendered["choices"], expected, strict=True):
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
        assert got["token_ids"] == want["token_ids"]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert_close(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], 1e-5)
    tokens = sum(reply["usage"]["total_tokens"] for reply in alone)
    assert derendered["usage"]["total_tokens"] == tokens


async def test_render_and_derender_refuse_what_they_cannot_answer_naming_the_field(client):
    chat = {"model": "policy", "messages": MESSAGES, "max_tokens": 3, "seed": 1}
    generated = await ok(
        await client.post(
            "/inference/v1/generate",
            json=await ok(await client.post("/v1/chat/completions/render", json=chat)),
        )
    )
    cases = [
        ("/v1/chat/completions/render", {**chat, "model": "nope"}, 404, "model"),
        ("/v1/chat/completions/render", {**chat, "trajectory_id": "t1"}, 400, "trajectory_id"),
        ("/v1/chat/completions/render", {**chat, "use_beam_search": True}, 400, "use_beam_search"),
        ("/v1/chat/completions/derender", {"generate_response": generated}, 400, "chat_request"),
        (
            "/v1/chat/completions/derender",
            {"generate_response": generated, "chat_request": {**chat, "n": 2}},
            400,
            "generate_response.choices",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": generated, "chat_request": {**chat, "logprobs": True}},
            400,
            "generate_response.choices[0].logprobs",
        ),
        (
            "/v1/chat/completions/derender",
            {"generate_response": generated, "chat_request": chat, "stream": True},
            400,
            "stream",
        ),
        (
            "/v1/completions/derender",
            {
                "generate_responses": [generated],
                "completion_request": {"model": "policy", "prompt": ["a", "b"]},
            },
            400,
            "generate_responses",
        ),
    ]
    for route, body, status, field in cases:
        response = await client.post(route, json=body)
        assert response.status_code == status, (route, field, response.text)
        assert response.json()["error"]["param"] == field, (route, response.text)
