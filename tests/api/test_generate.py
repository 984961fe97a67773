"""/v1/generate against plain transformers generation and against /v1/logprobs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.weights.test_pause import aborted_while_asking_for_extras


async def generate(client: httpx.AsyncClient, **body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def hf_greedy(model, ids: list[int], max_new_tokens: int, **kwargs) -> list[int]:  # type: ignore[no-untyped-def]
    x = torch.tensor([ids])
    out = model.generate(
        x,
        attention_mask=torch.ones_like(x),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        **kwargs,
    )
    return out[0, len(ids) :].tolist()


async def test_greedy_matches_transformers_generate(client, hf_model):
    prompts = [[72, 101, 108, 108, 111], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200]]
    body = await generate(client, tokens=prompts, max_new_tokens=12, do_sample=False)
    for prompt, samples in zip(prompts, body["outputs"], strict=True):
        (sample,) = samples
        expected = hf_greedy(hf_model, prompt, 12)
        assert sample["tokens"]["response"] == expected[: len(sample["tokens"]["response"])]
        assert sample["tokens"]["prompt"] + sample["tokens"]["response"] == sample["tokens"]["full"]


async def test_greedy_with_repetition_penalty_matches_transformers(client, hf_model):
    prompt = [10, 20, 30, 40]
    body = await generate(
        client, tokens=[prompt], max_tokens=16, temperature=0, repetition_penalty=1.5
    )
    expected = hf_greedy(hf_model, prompt, 16, repetition_penalty=1.5)
    assert body["outputs"][0][0]["tokens"]["response"] == expected


async def test_sampled_log_probs_equal_scoring(client):
    body = await generate(client, text=["Once upon a time", "x"], max_tokens=24, seed=3, n=2)
    for samples in body["outputs"]:
        for sample in samples:
            full = sample["tokens"]["full"]
            scored = (await client.post("/v1/logprobs", json={"tokens": [full]})).json()
            cut = len(sample["tokens"]["prompt"])
            expected = scored["outputs"][0]["log_probs"]["full"][cut:]
            assert_close(sample["log_probs"]["response"], expected, 1e-4)
            # temperature 1 and no filtering: the sampling distribution is the raw one
            processed = sample["log_probs"]["response_processed"]
            assert_close(processed, sample["log_probs"]["response"], 1e-4)


def processed_by_hand(
    model, prompt: list[int], response: list[int], **config: float
) -> list[float]:  # type: ignore[no-untyped-def]
    """Log-probs of `response` under the distribution sampled from, computed step by step:
    repetition penalty on every token seen so far, then temperature, then top-k."""
    penalty, temperature = config.get("repetition_penalty", 1.0), config["temperature"]
    top_k = int(config.get("top_k", 0))
    full = torch.tensor([prompt + response])
    with torch.inference_mode():
        logits = model(full).logits[0, len(prompt) - 1 : -1].float()
    values = []
    for step, token in enumerate(response):
        row = logits[step].clone()
        seen = torch.tensor(sorted(set(prompt + response[:step])))
        row[seen] = torch.where(row[seen] > 0, row[seen] / penalty, row[seen] * penalty)
        row = row / temperature
        if top_k:
            row[row < row.topk(top_k).values[-1]] = -torch.inf
        values.append(float(row.log_softmax(-1)[token]))
    return values


@pytest.mark.parametrize(
    "config",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 20, "repetition_penalty": 1.4},
    ],
)
async def test_processed_log_probs_are_the_sampling_distribution(client, hf_model, config):
    prompt = [50, 60, 70, 60]
    body = await generate(client, tokens=[prompt], max_tokens=8, seed=11, ignore_eos=True, **config)
    sample = body["outputs"][0][0]
    response = sample["tokens"]["response"]
    expected = processed_by_hand(hf_model, prompt, response, **config)
    assert_close(sample["log_probs"]["response_processed"], expected, 1e-4)
    raw = processed_by_hand(hf_model, prompt, response, temperature=1.0)
    assert_close(sample["log_probs"]["response"], raw, 1e-4)


async def test_greedy_processed_log_probs_have_the_penalty_only(client, hf_model):
    """Greedy rows score at temperature 1 without top-k/top-p, on both backends."""
    prompt = [10, 20, 30, 40]
    body = await generate(
        client, tokens=[prompt], max_tokens=8, temperature=0, top_k=3, repetition_penalty=1.5
    )
    sample = body["outputs"][0][0]
    response = sample["tokens"]["response"]
    expected = processed_by_hand(
        hf_model, prompt, response, temperature=1.0, repetition_penalty=1.5
    )
    assert_close(sample["log_probs"]["response_processed"], expected, 1e-4)


async def test_top_k_one_and_tiny_top_p_are_greedy(client, hf_model):
    prompt = [33, 44, 55]
    greedy = hf_greedy(hf_model, prompt, 10)
    for params in ({"top_k": 1}, {"top_p": 1e-6}):
        body = await generate(client, tokens=[prompt], max_tokens=10, seed=5, **params)
        sample = body["outputs"][0][0]
        assert sample["tokens"]["response"] == greedy
        assert sample["log_probs"]["response_processed"] == [0.0] * 10


async def test_seeded_sampling_is_reproducible(client):
    request = {"text": ["abc", "defgh"], "max_tokens": 16, "seed": 1234, "n": 3}
    first, second = await generate(client, **request), await generate(client, **request)
    # (the repeat's prompts come from the prefix cache: the same tokens, log-probs within
    # float32 rounding; batch-invariant mode is where values are bitwise)
    for again, before in zip(second["outputs"], first["outputs"], strict=True):
        for one, other in zip(again, before, strict=True):
            assert one["tokens"] == other["tokens"]
            assert_close(one["log_probs"]["response"], other["log_probs"]["response"], 1e-5)
    # ...also when batched with different neighbours (values differ only by padding noise).
    alone = await generate(client, **{**request, "text": ["abc"]})
    for single, batched in zip(alone["outputs"][0], first["outputs"][0], strict=True):
        assert single["tokens"] == batched["tokens"]
        assert_close(single["log_probs"]["response"], batched["log_probs"]["response"], 1e-4)
    other = await generate(client, **{**request, "seed": 4321})
    assert other["outputs"] != first["outputs"]
    responses = [s["tokens"]["response"] for s in first["outputs"][0]]
    assert len({tuple(r) for r in responses}) == 3


async def test_shape_and_alias_rules(client):
    body = await generate(
        client, text=["a", "b"], num_return_sequences=2, max_new_tokens=3, ignore_eos=True
    )
    assert [len(samples) for samples in body["outputs"]] == [2, 2]
    assert all(len(s["tokens"]["response"]) == 3 for ss in body["outputs"] for s in ss)
    body = await generate(
        client,
        text=["a"],
        num_return_sequences=2,
        n=4,
        max_new_tokens=3,
        max_tokens=5,
        ignore_eos=True,
    )
    assert len(body["outputs"][0]) == 4
    assert {len(s["tokens"]["response"]) for s in body["outputs"][0]} == {5}
    assert {s["finish_reason"] for s in body["outputs"][0]} == {"length"}
    body = await generate(client, text=["a"], max_tokens=2, return_log_probs=True, logprobs=False)
    assert "log_probs" not in body["outputs"][0][0]


async def test_stop_sequences_end_generation(client):
    base = await generate(client, text=["Stop here"], max_tokens=20, temperature=0, ignore_eos=True)
    text = base["outputs"][0][0]["text"]["response"]
    stop = next(text[i : i + 2] for i in range(4, len(text) - 1) if "\ufffd" not in text[i : i + 2])
    body = await generate(
        client,
        text=["Stop here"],
        max_tokens=20,
        temperature=0,
        stop_sequences=["never-appears"],
        stop=[stop],
        ignore_eos=True,
    )
    sample = body["outputs"][0][0]
    assert sample["finish_reason"] == "stop"
    assert sample["stop_reason"] == stop
    # generation ends right after the stop sequence's first occurrence, with the same tokens
    assert sample["text"]["response"] == text[: text.index(stop) + len(stop)]
    response = sample["tokens"]["response"]
    assert len(response) < 20
    assert response == base["outputs"][0][0]["tokens"]["response"][: len(response)]


async def test_history_mode(client, hf_tokenizer):
    conversation = [{"role": "user", "content": "Say hi"}]
    body = await generate(client, messages=[conversation], max_tokens=8, seed=0)
    sample = body["outputs"][0][0]
    prompt_text = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert sample["text"]["prompt"] == prompt_text
    assert (
        sample["tokens"]["prompt"]
        == hf_tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    )
    assert sample["text"]["full"] == hf_tokenizer.decode(sample["tokens"]["full"])
    response = sample["tokens"]["response"]
    assert sample["masks"]["all_assistant_mask"] == [0] * len(sample["tokens"]["prompt"]) + [
        1
    ] * len(response)
    content = hf_tokenizer.decode(response, skip_special_tokens=True)
    assert sample["history"]["response"] == [{"role": "assistant", "content": content}]
    assert sample["history"]["full"] == [*conversation, {"role": "assistant", "content": content}]


async def test_prompt_log_probs_on_request(client, reference_log_probs):
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    body = await generate(client, tokens=prompts, max_tokens=4, return_prompt_log_probs=True)
    for prompt, (sample,) in zip(prompts, body["outputs"], strict=True):
        assert_close(sample["log_probs"]["prompt"], reference_log_probs(prompt), 1e-5)
        assert_close(
            sample["log_probs"]["full"], reference_log_probs(sample["tokens"]["full"]), 1e-4
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"text": ["a"], "tokens": [[1]]}, "tokens"),
        ({"text": []}, "text"),
        ({"text": ["a"], "temperature": -0.1}, "temperature"),
        ({"text": ["a"], "top_p": 1.5}, "top_p"),
        ({"text": ["a"], "top_p": -0.5}, "top_p"),
        ({"text": ["a"], "top_k": 0}, "top_k"),
        ({"text": ["a"], "repetition_penalty": 0}, "repetition_penalty"),
        ({"text": ["a"], "do_sample": False, "temperature": 0.8}, "temperature"),
        ({"text": ["a"], "max_new_tokens": 0}, "max_new_tokens"),
        ({"text": ["a"], "max_new_tokens": 513}, "max_new_tokens"),
        ({"text": ["a"], "max_tokens": 10_000}, "max_tokens"),
        ({"text": ["a"], "n": 0}, "n"),
        ({"tokens": [[1, 2, 300]]}, "tokens[0]"),
        ({"tokens": [[1] * 4000], "max_tokens": 200}, "max_new_tokens"),
        ({"text": ["a"], "stop": [""]}, "stop[0]"),
        ({"text": ["a"], "unknown_knob": 1}, "unknown_knob"),
    ],
)
async def test_invalid_generation_requests(client, body, param):
    response = await client.post("/v1/generate", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


async def test_too_many_sequences(client, settings):
    limit = settings.limits.max_items_per_request
    response = await client.post("/v1/generate", json={"text": ["a"] * 4, "n": limit // 4 + 1})
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "text"
    assert (
        await client.post("/v1/generate", json={"text": ["a"], "max_tokens": 1})
    ).status_code == 200


async def test_seeded_prompts_longer_than_one_engine_step_all_generate(client):
    """Eight 600-token seeded prompts at once: more prompt tokens than vLLM schedules in one
    step (2048), which on CPU used to kill the engine when a prompt was split."""
    prompts = [[(i * 7 + j) % 250 + 1 for j in range(600)] for i in range(8)]
    responses = await asyncio.gather(
        *(
            generate(client, tokens=[p], max_tokens=3, seed=i, ignore_eos=True)
            for i, p in enumerate(prompts)
        )
    )
    assert [len(r["outputs"][0][0]["tokens"]["response"]) for r in responses] == [3] * 8
    again = await generate(client, tokens=[prompts[0]], max_tokens=3, seed=0, ignore_eos=True)
    assert again["outputs"][0][0]["tokens"] == responses[0]["outputs"][0][0]["tokens"]


async def test_generated_samples_mask_only_what_they_generated(client):
    """One assistant-mask rule for generated samples (as in env steps and rollouts): an earlier
    assistant turn in the prompt is context, 0; `/v1/logprobs` on the same conversation marks
    every assistant turn, as TorchRL's all_assistant_mask does."""
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    body = await generate(client, messages=[conversation], max_tokens=4, seed=0)
    sample = body["outputs"][0][0]
    num_prompt, num_response = len(sample["tokens"]["prompt"]), len(sample["tokens"]["response"])
    assert sample["masks"]["all_assistant_mask"] == [0] * num_prompt + [1] * num_response
    scored = await client.post("/v1/logprobs", json={"messages": [conversation[:2]]})
    assert sum(scored.json()["outputs"][0]["masks"]["all_assistant_mask"]) > 0


def steps_carry_raw(app) -> bool:  # type: ignore[no-untyped-def]
    """Whether vLLM's sampling steps carry raw log-probs in the processed mode: not on its
    second model runner (CUDA builds with Triton), whose sampler rlserve does not reach."""
    engine = app.state.registry.get("policy").backend.engine
    return not getattr(engine.vllm_config, "use_v2_model_runner", False)


async def test_abort_does_not_wait_for_an_aborted_rows_extras(app, client, backend_name):
    """As tests/weights/test_pause.py checks on the raw mode; here vLLM runs its processed
    mode, whose raw values come with each step: the aborted row keeps its tokens too (not
    where they take a pass of their own)."""
    keeps = backend_name != "vllm" or steps_carry_raw(app)
    await aborted_while_asking_for_extras(client, 512, keeps_tokens=keeps)  # (the app's limit)


async def test_processed_generation_takes_its_raw_log_probs_from_its_steps(
    app, client, hf_model, backend_name, monkeypatch
):
    """vLLM's processed mode: each sampling step carries the sampled token's raw log-prob
    beside the processed one, so no finished sequence is scored again for them (that pass
    refuses here); a batch with prompt log-probs, penalties and filtering included."""
    if backend_name != "vllm":
        pytest.skip("the transformers backend takes both from each step by construction")
    if not steps_carry_raw(app):
        pytest.skip("vLLM's second model runner: its steps carry no raw column")
    backend = app.state.registry.get("policy").backend

    async def no_second_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("a finished generation was scored again for its raw log-probs")

    monkeypatch.setattr(backend, "_score_one", no_second_pass)
    config = {"temperature": 1.3, "top_k": 20, "repetition_penalty": 1.4}
    prompts = [[50, 60, 70, 60], [7, 8], [200, 201, 202, 203, 204]]
    body = await generate(
        client,
        tokens=prompts,
        max_tokens=12,
        seed=5,
        ignore_eos=True,
        return_prompt_log_probs=True,
        **config,
    )
    for prompt, (sample,) in zip(prompts, body["outputs"], strict=True):
        response = sample["tokens"]["response"]
        assert len(response) == 12
        expected = processed_by_hand(hf_model, prompt, response, **config)
        assert_close(sample["log_probs"]["response_processed"], expected, 1e-4)
        full = forward_log_probs(hf_model, prompt + response)
        assert_close(sample["log_probs"]["response"], full[len(prompt) :], 1e-4)
        assert_close(sample["log_probs"]["prompt"], full[: len(prompt)], 1e-4)
