"""The reward calls of SGLang's embeddings (as verl reads them), OpenRLHF and slime, in the
bodies their code sends (tests/trainers runs verl's and OpenRLHF's own code against these
routes), each answering the reward model's own forward of the same tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from tests.rewards.conftest import forward_reward


async def test_sglang_embeddings_answer_the_heads_raw_output(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
    answer = await rewarded.post(
        "/v1/embeddings", json={"model": "builtin:tiny-reward", "input": text}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    expected = forward_reward(reward_model, tokenizer(text)["input_ids"])
    assert abs(body["data"][-1]["embedding"][-1] - expected) <= 1e-5
    assert body["data"][0]["object"] == "embedding" and body["object"] == "list"


async def test_openrlhf_get_reward_answers_rewards_and_scores(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    queries = ["<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n2", "plain text"]
    body = {"query": queries, "prompts": ["p1", "p2"], "labels": ["2", None]}
    answer = await rewarded.post("/get_reward", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    expected = [
        forward_reward(reward_model, tokenizer(q, add_special_tokens=False)["input_ids"])
        for q in queries
    ]
    assert got["scores"] == got["rewards"] and got["extra_logs"] == {}
    for reward, want in zip(got["rewards"], expected, strict=True):
        assert abs(reward - want) <= 1e-5
    mismatched = await rewarded.post("/get_reward", json={"query": ["a"], "labels": [1, 2]})
    assert mismatched.status_code == 422 and mismatched.json()["error"]["param"] == "labels"


async def test_slime_reward_is_a_number_or_keyed_by_its_reward_key(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    sample = {"prompt": prompt, "response": "Blue.<|im_end|>", "label": "blue"}
    plain = await rewarded.post("/slime/reward", json=sample)
    assert plain.status_code == 200, plain.text
    ids = tokenizer(prompt + "Blue.<|im_end|>", add_special_tokens=False)["input_ids"]
    assert abs(plain.json() - forward_reward(reward_model, ids)) <= 1e-5
    keyed = await rewarded.post("/slime/reward?reward_key=score", json=sample)
    assert keyed.json() == {"score": plain.json()}

    messages = [{"role": "user", "content": "Name a colour."}]
    chat = await rewarded.post(
        "/slime/reward", json={"prompt": messages, "response": "Blue.", "label": None}
    )
    conversation = [*messages, {"role": "assistant", "content": "Blue."}]
    templated = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert abs(chat.json() - forward_reward(reward_model, templated)) <= 1e-5
