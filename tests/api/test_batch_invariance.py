"""Batch-invariant mode: a sequence's scores, and a generated row's tokens and log-probs, are
bitwise the same whatever is sent beside it, and the log-probs a row was sampled with are
bitwise those /v1/logprobs gives its tokens. Compared with ==, never a tolerance."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import httpx
import pytest

from app.config import Settings
from tests.conftest import served_app, vllm_installed

rng = random.Random(7)
# Mixed lengths (3 to 40 tokens): a batch of them is padded to its longest.
SEQUENCES = [[rng.randrange(5, 250) for _ in range(rng.randrange(3, 41))] for _ in range(32)]
TARGET = SEQUENCES[0]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
async def served(
    settings: Settings, request: pytest.FixtureRequest
) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        models={"dtype": request.param, "load_reference": False},
        storage={"data_dir": settings.storage.data_dir / f"invariant-{request.param}"},
    )
    async with served_app(config, timeout=120) as c:
        yield c


async def scores(
    client: httpx.AsyncClient, sequences: list[list[int]], **flags: object
) -> list[list[float]]:
    response = await client.post("/v1/logprobs", json={"tokens": sequences, **flags})
    assert response.status_code == 200, response.text
    return [o["log_probs"]["full"] for o in response.json()["outputs"]]


async def generate(
    client: httpx.AsyncClient, prompt: list[int], **flags: object
) -> tuple[list[int], list[float]]:
    body = {"tokens": [prompt], "max_new_tokens": 12, "seed": 5, "ignore_eos": True, **flags}
    response = await client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    sample = response.json()["outputs"][0][0]
    return sample["tokens"]["response"], sample["log_probs"]["response"]


async def test_a_sequences_scores_are_the_same_whatever_it_is_sent_with(served):
    (alone,) = await scores(served, [TARGET], batch_invariant=True)
    for size in (8, 32):  # the target first, then others of every length
        assert (await scores(served, SEQUENCES[:size], batch_invariant=True))[0] == alone
    # ... and beside other requests in flight, which batch among themselves
    results = await asyncio.gather(
        scores(served, [TARGET], batch_invariant=True),
        *(scores(served, SEQUENCES[i : i + 4]) for i in range(1, 29, 4)),
    )
    assert results[0][0] == alone
    # The detailed path (extras asked) is invariant too.
    detailed = await served.post(
        "/v1/logprobs",
        json={"tokens": SEQUENCES[:8], "top_logprobs": 2, "batch_invariant": True},
    )
    assert detailed.json()["outputs"][0]["log_probs"]["full"] == alone


async def test_a_rows_tokens_and_log_probs_are_the_same_whatever_it_is_sent_with(served):
    prompt = SEQUENCES[1][:8]
    tokens, log_probs = await generate(served, prompt, batch_invariant=True)
    others = [generate(served, s[:10], batch_invariant=True) for s in SEQUENCES[2:9]]
    busy = [scores(served, SEQUENCES[10:18])]  # scoring in flight beside it
    again, *_ = await asyncio.gather(generate(served, prompt, batch_invariant=True), *others, *busy)
    assert again == (tokens, log_probs)
    # The log-probs it was sampled with are /v1/logprobs of its tokens, bitwise.
    (full,) = await scores(served, [prompt + tokens], batch_invariant=True)
    assert full[len(prompt) :] == log_probs


async def test_the_server_setting_makes_every_request_invariant(settings):
    config = settings.replace(
        models={"load_reference": False},
        batching={"invariant": True},
        storage={"data_dir": settings.storage.data_dir / "invariant-setting"},
    )
    async with served_app(config, timeout=120) as c:
        prompt = SEQUENCES[3][:6]
        tokens, log_probs = await generate(c, prompt)
        (full,) = await scores(c, [prompt + tokens])
        assert full[len(prompt) :] == log_probs
        (alone,) = await scores(c, [TARGET])
        assert (await scores(c, SEQUENCES[:8]))[0] == alone
        # The OpenAI route's sampled log-probs are the same pass's too.
        chat = await c.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 6,
                "logprobs": 0,
                "seed": 2,
                "return_token_ids": True,
            },
        )
        assert chat.status_code == 200, chat.text
        choice = chat.json()["choices"][0]
        ids = choice["token_ids"]
        (full,) = await scores(c, [prompt + ids])
        assert choice["logprobs"]["token_logprobs"] == full[len(prompt) :]


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_the_vllm_backend_refuses_batch_invariant_mode_by_name(settings):
    from tests.conftest import backend_settings

    config = backend_settings(settings, "vllm").replace(models={"load_reference": False})
    async with served_app(config, timeout=120) as c:
        refused = await c.post("/v1/logprobs", json={"tokens": [TARGET], "batch_invariant": True})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error"]["param"] == "batch_invariant"
        assert "transformers backend" in refused.json()["error"]["message"]
