"""vLLM's and SGLang's generation and control routes against rlserve's own: the same tokens and
log-probs as /v1/generate for the same seed, prompt log-probs and ranks against a plain
forward, pauses that hold and release, admin keys on control routes, refusals that name what
is refused."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import torch
from fastapi import FastAPI

from app.config import Settings
from app.dialects.refusals import REFUSED
from app.main import create_app
from tests.conftest import assert_close, forward_log_probs, served_app

PREFIX_FLOOR = 1e-5
"""The same prompt sent to two routes: the second's keys and values come from the prefix
cache, so its log-probs agree within float32 rounding (a few 1e-6 here), not bitwise."""
PROMPTS = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7]]


async def ok(response: httpx.Response) -> dict:  # type: ignore[type-arg]
    assert response.status_code == 200, response.text
    return response.json()


async def ours(client: httpx.AsyncClient, prompts: list[list[int]], **body: object) -> list:  # type: ignore[type-arg]
    answer = await ok(await client.post("/v1/generate", json={"tokens": prompts, **body}))
    return [s for group in answer["outputs"] for s in group]


async def test_vllm_completions_of_token_prompts_equal_v1_generate(client):
    body = {
        "prompt": PROMPTS,
        "n": 2,
        "max_tokens": 6,
        "seed": 7,
        "logprobs": 2,
        "top_k": 0,
        "min_p": 0.0,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    answer = await ok(await client.post("/v1/completions", json=body))
    expected = await ours(client, PROMPTS, n=2, max_new_tokens=6, seed=7)
    assert len(answer["choices"]) == len(expected) == 4
    for k, (choice, sample) in enumerate(zip(answer["choices"], expected, strict=True)):
        assert choice["prompt_token_ids"] == PROMPTS[k // 2]  # prompt-major, as TRL reads them
        assert choice["token_ids"] == sample["tokens"]["response"]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        expected_lps = sample["log_probs"]["response"]
        assert_close(choice["logprobs"]["token_logprobs"], expected_lps, PREFIX_FLOOR)
        for row in choice["logprobs"]["top_logprobs"]:
            assert len(row) == 2 and all(key.startswith("token_id:") for key in row)
    body["logprobs"] = 0  # the chosen token alone at each position (TRL reads the key)
    answer = await ok(await client.post("/v1/completions", json=body))
    for choice in answer["choices"]:
        tops = choice["logprobs"]["top_logprobs"]
        names = [f"token_id:{t}" for t in choice["token_ids"]]
        assert [list(row) for row in tops] == [[name] for name in names]
        assert [row[n] for row, n in zip(tops, names, strict=True)] == choice["logprobs"][
            "token_logprobs"
        ]


async def test_vllm_prompt_logprobs_against_a_plain_forward(client, hf_model):
    body = {"prompt": PROMPTS, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 1.0}
    answer = await ok(await client.post("/v1/completions", json=body))
    for choice, prompt in zip(answer["choices"], PROMPTS, strict=True):
        rows = choice["prompt_logprobs"]
        assert rows[0] is None and len(rows) == len(prompt)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
        own = forward_log_probs(hf_model, prompt)
        for p in range(1, len(prompt)):
            row = rows[p]
            mine = row[str(prompt[p])]
            assert abs(mine["logprob"] - own[p]) < 1e-5
            assert mine["rank"] == int((logits[p - 1] > logits[p - 1, prompt[p]]).sum()) + 1
            top = logits[p - 1].topk(3)
            for r, (token, value) in enumerate(
                zip(top.indices.tolist(), top.values.tolist(), strict=True)
            ):
                assert abs(row[str(token)]["logprob"] - value) < 1e-5
                assert row[str(token)]["rank"] == r + 1 or token == prompt[p]


async def test_prompt_logprobs_take_the_generation_pass_where_the_engine_can(
    app, client, monkeypatch
):
    """vLLM scores a prompt in the pass that generates from it; an engine that cannot scores
    each prompt once in a pass of its own. Either way the rows sampled from a prompt share its
    prompt_logprobs, raw whatever the sampling temperature: equal to /v1/logprobs."""
    backend = app.state.registry.get("policy").backend
    asked = {"generated": 0, "scored": 0}
    generate, score_detailed = backend.generate, backend.score_detailed

    async def counted_generate(items):  # type: ignore[no-untyped-def]
        asked["generated"] += len(items)
        return await generate(items)

    async def counted_score(items):  # type: ignore[no-untyped-def]
        asked["scored"] += len(items)
        return await score_detailed(items)

    monkeypatch.setattr(backend, "generate", counted_generate)
    monkeypatch.setattr(backend, "score_detailed", counted_score)
    body = {
        "prompt": PROMPTS,
        "max_tokens": 2,
        "n": 2,
        "prompt_logprobs": 1,
        "seed": 5,
        "temperature": 0.7,
    }
    answer = await ok(await client.post("/v1/completions", json=body))
    assert asked["generated"] == 2 * len(PROMPTS)
    assert asked["scored"] == (0 if backend.capabilities.prompt_scores else len(PROMPTS))
    scored = await ok(await client.post("/v1/logprobs", json={"tokens": PROMPTS}))
    for choice in answer["choices"]:
        prompt = PROMPTS[choice["index"] // 2]
        rows = choice["prompt_logprobs"]
        assert rows == answer["choices"][choice["index"] ^ 1]["prompt_logprobs"]
        own = [rows[p][str(prompt[p])]["logprob"] for p in range(1, len(prompt))]
        expected = scored["outputs"][choice["index"] // 2]["log_probs"]["full"][1:]
        assert_close(own, expected, 1e-5)
    one = {"prompt": [[5]], "max_tokens": 1, "prompt_logprobs": 2}
    answer = await ok(await client.post("/v1/completions", json=one))
    assert answer["choices"][0]["prompt_logprobs"] == [None]


async def test_min_p_keeps_only_tokens_near_the_most_likely(client, hf_model):
    prompt = PROMPTS[0]
    body = {
        "prompt": [prompt],
        "max_tokens": 1,
        "n": 24,
        "seed": 3,
        "min_p": 0.3,
        "return_token_ids": True,
    }
    answer = await ok(await client.post("/v1/completions", json=body))
    with torch.no_grad():
        probs = hf_model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
    allowed = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    assert {c["token_ids"][0] for c in answer["choices"]} <= allowed


async def test_vllm_inference_generate_equals_v1_generate(client):
    body = {
        "token_ids": PROMPTS[1],
        "sampling_params": {"n": 2, "max_tokens": 5, "seed": 11, "logprobs": 1, "top_k": -1},
        "return_token_ids": True,
    }
    answer = await ok(await client.post("/inference/v1/generate", json=body))
    expected = await ours(client, [PROMPTS[1]], n=2, max_new_tokens=5, seed=11)
    assert answer["prompt_token_ids"] == PROMPTS[1]
    for choice, sample in zip(answer["choices"], expected, strict=True):
        assert choice["token_ids"] == sample["tokens"]["response"]
        content = choice["logprobs"]["content"]
        assert [c["token_id"] for c in content] == choice["token_ids"]
        assert_close([c["logprob"] for c in content], sample["log_probs"]["response"], PREFIX_FLOOR)
        assert all(c["rank"] >= 1 for c in content)
        assert choice["weight_versions"][0]["start"] == 0


async def test_sglang_generate_equals_v1_generate(client, hf_model):
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": 5, "n": 2, "sampling_seed": 5, "top_k": -1},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    answer = await ok(await client.post("/generate", json=body))
    expected = await ours(client, PROMPTS, n=2, max_new_tokens=5, seed=5)
    assert isinstance(answer, list) and len(answer) == 4
    for k, (out, sample) in enumerate(zip(answer, expected, strict=True)):
        meta = out["meta_info"]
        assert out["output_ids"] == sample["tokens"]["response"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        got = [v for v, _, _ in meta["output_token_logprobs"]]
        assert_close(got, sample["log_probs"]["response"], PREFIX_FLOOR)
        prompt = PROMPTS[k // 2]
        inputs = meta["input_token_logprobs"]
        assert [t for _, t, _ in inputs] == prompt and inputs[0][0] is None
        assert_close([v for v, _, _ in inputs[1:]], forward_log_probs(hf_model, prompt)[1:], 1e-5)
        assert meta["finish_reason"]["type"] in ("stop", "length")
        assert meta["weight_version"] == str(sample["policy_versions"][-1]["version"])
    single = await ok(
        await client.post(
            "/generate",
            json={
                "input_ids": PROMPTS[0],
                "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            },
        )
    )
    assert isinstance(single, dict) and single["meta_info"]["completion_tokens"] <= 3


async def test_control_routes_hold_and_release_serving(client):
    assert (await ok(await client.get("/is_paused"))) == {"is_paused": False}
    assert (await ok(await client.post("/pause?mode=keep")))["status"] == "paused"
    assert (await ok(await client.get("/is_paused")))["is_paused"]
    assert (await ok(await client.get("/v1/serving")))["mode"] == "keep"
    assert (await ok(await client.post("/resume")))["status"] == "resumed"
    await ok(await client.post("/pause_generation", json={"mode": "in_place"}))
    assert (await ok(await client.get("/v1/serving")))["mode"] == "keep"
    await ok(await client.post("/continue_generation", json={}))
    assert not (await ok(await client.get("/is_paused")))["is_paused"]
    assert (await ok(await client.post("/abort_requests", json={})))["status"] == "aborted"
    info = await ok(await client.get("/server_info"))
    assert info["vllm_config"]["weight_transfer_config"]["backend"] in ("gloo", "nccl")
    assert (await ok(await client.get("/get_world_size")))["world_size"] >= 1
    assert (await ok(await client.post("/reset_prefix_cache")))["success"]
    version = (await ok(await client.get("/v1/weights/version")))["policy_version"]
    assert (await ok(await client.get("/get_weight_version")))["weight_version"] == str(version)
    confirmed = await client.post("/update_weight_version", json={"new_version": str(version)})
    assert confirmed.status_code == 200
    other = await client.post("/update_weight_version", json={"new_version": "step-9"})
    assert other.status_code == 409 and other.json()["error"]["param"] == "new_version"
    assert (await client.get("/health_generate")).status_code == 200


async def test_unsupported_requests_name_what_they_ask(client):
    cases = [
        (
            "/inference/v1/generate",
            {"token_ids": [1, 2], "sampling_params": {"structured_outputs": {"json": {}}}},
            "sampling_params.structured_outputs",
        ),
        ("/generate", {"input_ids": [1, 2], "image_data": [{"url": "x"}]}, "image_data"),
        (
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}},
            "sampling_params.json_schema",
        ),
        ("/abort_request", {"rid": "abc"}, "rid"),
        (
            "/init_weight_transfer_engine",
            {
                "init_info": {
                    "nccl_unique_id_b64": "AAAA",
                    "world_size": 2,
                    "master_address": "h",
                    "master_port": 1,
                }
            },
            "init_info",
        ),
        ("/finish_weight_update", {"weight_version": "v7"}, "weight_version"),
    ]
    for path, body, field in cases:
        refused = await client.post(path, json=body)
        assert 400 <= refused.status_code < 500, (path, refused.text)
        assert field in refused.text, (path, refused.text)
    for path in REFUSED:
        refused = await client.post(path, json={})
        assert refused.status_code == 422 and path.strip("/") in refused.json()["error"]["param"]


@pytest.fixture
async def guarded(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    app: FastAPI = create_app(
        settings.replace(auth={"api_keys": ["user-key"], "admin_api_keys": ["admin-key"]}),
        load_models=False,
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rlserve") as c:
            yield c


async def test_control_and_weight_routes_need_the_admin_key(guarded, client):
    user = {"Authorization": "Bearer user-key"}
    control = [
        "/pause",
        "/resume",
        "/abort_requests",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/pause_generation",
        "/continue_generation",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weights_from_disk",
        "/begin_weight_update",
        "/end_weight_update",
        "/flush_cache",
    ]
    for path in control:
        assert (await guarded.post(path, json={}, headers=user)).status_code == 403, path
        assert (await guarded.post(path, json={})).status_code == 401, path
    spec = (await client.get("/openapi.json")).json()
    for path in control:
        assert "403" in spec["paths"][path]["post"]["responses"], path


async def test_the_servers_tokens_as_token_ids_name_every_token_by_its_id(settings):
    """vLLM's --return-tokens-as-token-ids (ART starts its vLLM with it, and ART 0.5.18 never
    asks per request: it reads the ids back from the names): the OpenAI routes' log-probs,
    streamed or not, name each token 'token_id:<id>' unless a request says false."""
    config = settings.replace(
        models={"return_tokens_as_token_ids": True},
        storage={"data_dir": settings.storage.data_dir / "token-ids"},
    )
    messages = [{"role": "user", "content": "What is 2+2?"}]
    common = {"max_tokens": 6, "seed": 2, "logprobs": True, "return_token_ids": True}
    async with served_app(config) as client:
        chat = await ok(
            await client.post("/v1/chat/completions", json={"messages": messages, **common})
        )
        (choice,) = chat["choices"]
        names = [entry["token"] for entry in choice["logprobs"]["content"]]
        assert names == [f"token_id:{t}" for t in choice["token_ids"]]
        body = {"prompt": PROMPTS[0], **common, "logprobs": 1}
        completion = await ok(await client.post("/v1/completions", json=body))
        (choice,) = completion["choices"]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        streamed = await client.post(
            "/v1/chat/completions", json={"messages": messages, **common, "stream": True}
        )
        lines = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: {")]
        entries = [
            entry["token"]
            for chunk in map(json.loads, lines)
            for c in chunk["choices"]
            for entry in ((c.get("logprobs") or {}).get("content") or [])
        ]
        assert entries and all(name.startswith("token_id:") for name in entries)
        own = {"messages": messages, **common, "return_tokens_as_token_ids": False}
        text = await ok(await client.post("/v1/chat/completions", json=own))
        assert not any(
            e["token"].startswith("token_id:") for e in text["choices"][0]["logprobs"]["content"]
        )
