"""vLLM's `/classify` and `/pooling` on the reward model: the head's output as the model's own
forward gives it (raw with use_activation false, vLLM's sigmoid otherwise), for strings, token
ids and a conversation; what rlserve cannot honour is refused by name."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from app.config import Settings
from tests.conftest import served_app
from tests.rewards.conftest import forward_reward

CONVERSATION = [
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "content": "Yes: its only divisors are 1 and 7."},
]


async def test_classify_answers_the_heads_output_as_vllm_does(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    texts = ["first answer", "a second, longer answer to read"]
    raw = await rewarded.post(
        "/classify", json={"model": "builtin:tiny-reward", "input": texts, "use_activation": False}
    )
    assert raw.status_code == 200, raw.text
    body = raw.json()
    assert body["object"] == "list" and body["model"] == "builtin:tiny-reward"
    assert [d["index"] for d in body["data"]] == [0, 1]
    expected = [forward_reward(reward_model, tokenizer(t)["input_ids"]) for t in texts]
    for data, reward in zip(body["data"], expected, strict=True):
        assert data["num_classes"] == 1 and len(data["probs"]) == 1
        assert abs(data["probs"][-1] - reward) <= 1e-5
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer(t)["input_ids"]) for t in texts)

    activated = await rewarded.post("/classify", json={"input": texts[0]})
    (data,) = activated.json()["data"]
    assert abs(data["probs"][0] - 1 / (1 + math.exp(-expected[0]))) <= 1e-6

    ids = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    chat = await rewarded.post(
        "/classify", json={"messages": CONVERSATION, "use_activation": False}
    )
    assert chat.status_code == 200, chat.text
    assert abs(chat.json()["data"][0]["probs"][0] - forward_reward(reward_model, ids)) <= 1e-5

    tokens = await rewarded.post("/classify", json={"input": ids, "use_activation": False})
    assert tokens.json()["data"][0]["probs"] == chat.json()["data"][0]["probs"]


async def test_pooling_gives_the_head_at_the_pooled_token_or_every_token(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module
) -> None:
    ids = [[3, 4, 5, 6], [90, 91]]
    pooled = await rewarded.post("/pooling", json={"input": ids, "use_activation": False})
    assert pooled.status_code == 200, pooled.text
    for data, row in zip(pooled.json()["data"], ids, strict=True):
        assert data["object"] == "pooling"
        assert abs(data["data"][0] - forward_reward(reward_model, row)) <= 1e-5
    per_token = await rewarded.post(
        "/pooling", json={"input": ids[0], "task": "token_classify", "use_activation": False}
    )
    (data,) = per_token.json()["data"]
    with torch.inference_mode():
        hidden = reward_model.model(torch.tensor([ids[0]])).last_hidden_state
        expected = reward_model.score(hidden)[0].tolist()
    assert len(data["data"]) == len(ids[0])
    for got, want in zip(data["data"], expected, strict=True):
        assert abs(got[0] - want[0]) <= 1e-5


async def test_what_cannot_be_honoured_is_refused_by_name(rewarded: httpx.AsyncClient) -> None:
    cases = {
        "input": {"input": "x", "messages": CONVERSATION},
        "truncate_prompt_tokens": {"input": "x", "truncate_prompt_tokens": 4},
        "task": {"input": "x", "task": "embed"},
        "model": {"input": "x", "model": "policy"},
    }
    for param, body in cases.items():
        answer = await rewarded.post("/pooling" if param == "task" else "/classify", json=body)
        assert answer.status_code == 422, (param, answer.text)
        assert answer.json()["error"]["param"] == param, answer.text
    too_long = await rewarded.post("/classify", json={"input": [[1, 2], [7] * 301]})
    assert too_long.status_code == 422 and too_long.json()["error"]["param"] == "input[1]"
    empty = await rewarded.post("/classify", json={"input": []})
    assert empty.status_code == 422


async def test_classify_without_a_reward_model_names_the_setting(settings: Settings) -> None:
    async with served_app(settings.replace(models={"load_reference": False})) as plain:
        answer = await plain.post("/classify", json={"input": "x"})
    assert answer.status_code == 404 and "--reward-model" in answer.json()["error"]["message"]
