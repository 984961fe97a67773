"""/v1/rewards: the reward model served beside the policy scores what
`AutoModelForSequenceClassification`'s own forward scores, one unpadded sequence at a time,
whatever the batch; bad input is a 4xx naming its field."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from app.config import Settings
from tests.conftest import served_app
from tests.rewards.conftest import forward_reward

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a prime number above ten."},
        {"role": "assistant", "content": "Thirteen is prime, and so is eleven."},
    ],
]


async def test_rewards_equal_the_models_own_forward_whatever_the_batch(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    texts = ["a short one", "a longer answer, " * 9 + "with a tail"]
    tokens = [[5, 9, 13, 77, 101], [40] * 3, list(range(60, 180))]
    bodies = [
        {"messages": CONVERSATIONS},
        {"text": texts},
        {"tokens": tokens},
        {"prompt_text": ["Q: 1+1?\nA:"], "response_text": [" 2"]},
    ]
    # sent at once, so their rows share model calls
    answers = await asyncio.gather(*(rewarded.post("/v1/rewards", json=b) for b in bodies))
    for answer in answers:
        assert answer.status_code == 200, answer.text
    expected_ids = [
        [tokenizer.apply_chat_template(c, tokenize=True, return_dict=False) for c in CONVERSATIONS],
        [tokenizer(t)["input_ids"] for t in texts],
        tokens,
        [tokenizer("Q: 1+1?\nA:")["input_ids"] + tokenizer(" 2")["input_ids"]],
    ]
    for answer, ids_list in zip(answers, expected_ids, strict=True):
        outputs = answer.json()["outputs"]
        assert len(outputs) == len(ids_list)
        for output, ids in zip(outputs, ids_list, strict=True):
            assert output["num_tokens"] == len(ids)
            assert abs(output["reward"] - forward_reward(reward_model, ids)) <= 1e-5
    # the rewards differ from row to row: the comparison above could fail
    rewards = [o["reward"] for a in answers for o in a.json()["outputs"]]
    assert len({round(r, 4) for r in rewards}) == len(rewards)
    assert answers[0].json()["outputs"][0]["token_ids"] == expected_ids[0][0]
    assert "token_ids" not in answers[2].json()["outputs"][0]


async def test_token_values_are_the_head_at_every_token(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module
) -> None:
    ids = [12, 200, 45, 45, 9, 31]
    answer = await rewarded.post("/v1/rewards", json={"tokens": [ids], "token_values": True})
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    with torch.inference_mode():
        hidden = reward_model.model(torch.tensor([ids])).last_hidden_state
        expected = reward_model.score(hidden)[0, :, 0].tolist()
    assert len(output["token_values"]) == len(ids)
    assert max(abs(a - b) for a, b in zip(output["token_values"], expected, strict=True)) <= 1e-5
    assert output["reward"] == output["token_values"][-1]


async def test_a_sequence_ending_in_the_pad_token_is_read_where_the_model_reads_it(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module
) -> None:
    pad = reward_model.config.pad_token_id
    ids = [70, 71, 72, pad]
    answer = await rewarded.post("/v1/rewards", json={"tokens": [ids], "token_values": True})
    (output,) = answer.json()["outputs"]
    assert abs(output["reward"] - forward_reward(reward_model, ids)) <= 1e-5
    assert output["reward"] == output["token_values"][2]  # (the last token that is not pad)


async def test_the_reward_model_is_listed_under_its_names(rewarded: httpx.AsyncClient) -> None:
    cards = (await rewarded.get("/v1/models")).json()["data"]
    ids = {card["id"] for card in cards}
    assert {"policy", "reward", "builtin:tiny-reward"} <= ids
    reward = next(card for card in cards if card["id"] == "reward")
    assert "reward" in reward["root"]
    by_source = await rewarded.post(
        "/v1/rewards", json={"model": "builtin:tiny-reward", "tokens": [[1, 2, 3]]}
    )
    assert by_source.status_code == 200, by_source.text


async def test_bad_input_is_refused_by_name(rewarded: httpx.AsyncClient) -> None:
    too_long = await rewarded.post("/v1/rewards", json={"tokens": [[1, 2], [5] * 301]})
    assert too_long.status_code == 422
    assert too_long.json()["error"]["param"] == "tokens[1]"
    other = await rewarded.post("/v1/rewards", json={"model": "policy", "tokens": [[1, 2]]})
    assert other.status_code == 422 and other.json()["error"]["param"] == "model"
    outside = await rewarded.post("/v1/rewards", json={"tokens": [[1, 10**6]]})
    assert outside.status_code == 422 and outside.json()["error"]["param"] == "tokens[0]"
    none = await rewarded.post("/v1/rewards", json={})
    assert none.status_code == 422


async def test_a_server_without_a_reward_model_names_the_setting(settings: Settings) -> None:
    async with served_app(settings.replace(models={"load_reference": False})) as plain:
        answer = await plain.post("/v1/rewards", json={"tokens": [[1, 2, 3]]})
        load = await plain.post("/v1/rewards/weights", json={"path": "/nonexistent"})
    for refused in (answer, load):
        assert refused.status_code == 404
        assert "--reward-model" in refused.json()["error"]["message"]
