"""On the real model, what rlserve returns equals plain transformers: greedy replies token for
token, scores as a plain forward, generation log-probs as scoring of the same tokens, and
assistant masks as the chat template places the assistant turns."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.realmodel.conftest import post

pytestmark = pytest.mark.slow
QUESTIONS = [
    "What is the capital of France?",
    "Name a colour of the sky.",
    "What is 7 + 5?",
]
# Scores of a plain unbatched float32 forward vs the server's batched one (measured: 3e-5).
TOLERANCE = 1e-4


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


async def test_greedy_replies_are_transformers_generate(real_client, real_hf, real_tokenizer):
    body = {"messages": [chat(q) for q in QUESTIONS], "max_tokens": 24, "temperature": 0}
    outputs = (await post(real_client, "/v1/generate", body))["outputs"]
    eos = real_tokenizer.eos_token_id
    for question, (sample,) in zip(QUESTIONS, outputs, strict=True):
        prompt = real_tokenizer.apply_chat_template(
            chat(question), add_generation_prompt=True, tokenize=True
        )["input_ids"]
        assert sample["tokens"]["prompt"] == prompt
        with torch.inference_mode():
            out = real_hf.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=24, pad_token_id=eos
            )
        expected = out[0, len(prompt) :].tolist()
        assert sample["tokens"]["response"] == expected[: len(sample["tokens"]["response"])]
        assert len(sample["tokens"]["response"]) == len(expected)
    assert "Paris" in outputs[0][0]["text"]["response"]


async def test_scores_are_a_plain_forward(real_client, real_hf, real_tokenizer):
    texts = [
        "The capital of France is Paris.",
        "7 + 5 = 12, and 12 - 5 = 7.",
        "Ein kurzer deutscher Satz über Bäume 🌳.",
    ]
    scored = (await post(real_client, "/v1/logprobs", {"text": texts}))["outputs"]
    for text, sample in zip(texts, scored, strict=True):
        ids = real_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert sample["tokens"]["full"] == ids
        assert_close(sample["log_probs"]["full"], forward_log_probs(real_hf, ids), TOLERANCE)


async def test_sampled_log_probs_are_the_scores_of_the_same_tokens(real_client):
    body = {
        "messages": [chat(q) for q in QUESTIONS],
        "n": 2,
        "max_tokens": 20,
        "temperature": 1.0,
        "seed": 7,
    }
    outputs = (await post(real_client, "/v1/generate", body))["outputs"]
    samples = [s for group in outputs for s in group]
    split = {
        "prompt_tokens": [s["tokens"]["prompt"] for s in samples],
        "response_tokens": [s["tokens"]["response"] for s in samples],
    }
    scored = (await post(real_client, "/v1/logprobs", split))["outputs"]
    for sample, score in zip(samples, scored, strict=True):
        assert_close(sample["log_probs"]["response"], score["log_probs"]["response"], TOLERANCE)


async def test_assistant_masks_follow_the_template(real_client, real_tokenizer):
    """The template has no generation tags: the mask is 1 exactly on each assistant turn's
    content and its <|im_end|>, found here by rendering the conversation's prefixes."""
    conversation = [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
    ]
    (sample,) = (await post(real_client, "/v1/logprobs", {"messages": [conversation]}))["outputs"]
    full = sample["tokens"]["full"]
    expected = [0] * len(full)
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = real_tokenizer.apply_chat_template(
            conversation[:i], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        turn = real_tokenizer(message["content"] + "<|im_end|>", add_special_tokens=False)
        assert full[len(before) : len(before) + len(turn["input_ids"])] == turn["input_ids"]
        expected[len(before) : len(before) + len(turn["input_ids"])] = [1] * len(turn["input_ids"])
    assert sample["masks"]["all_assistant_mask"] == expected
