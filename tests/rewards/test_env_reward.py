"""`reward: "model"` in a chat or text environment: each turn's reward is the served reward
model's, for the conversation up to and including the action (or the text with it): what
`/v1/rewards` answers, and the model's own forward of the same tokens."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch
from transformers import AutoTokenizer

from app.config import Settings
from tests.conftest import served_app
from tests.rewards.conftest import forward_reward

SYSTEM = "Answer briefly."


async def test_a_chat_environments_turns_are_rewarded_by_the_reward_model(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    created = await rewarded.post(
        "/v1/envs", json={"reward": "model", "batch_size": 2, "system_prompt": SYSTEM}
    )
    assert created.status_code == 201, created.text
    env = created.json()["env_id"]
    queries = ["What is 2+3?", "Name a colour."]
    reset = await rewarded.post(f"/v1/envs/{env}/reset", json={"query": queries})
    assert reset.status_code == 200, reset.text
    actions = [{"text": "It is 5."}, {"text": "Blue, like the sky."}]
    step = await rewarded.post(f"/v1/envs/{env}/step", json={"actions": actions})
    assert step.status_code == 200, step.text
    outputs = step.json()["outputs"]
    conversations = [
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": query},
            {"role": "assistant", "content": action["text"]},
        ]
        for query, action in zip(queries, actions, strict=True)
    ]
    served = await rewarded.post("/v1/rewards", json={"messages": conversations})
    for output, conversation, answer in zip(
        outputs, conversations, served.json()["outputs"], strict=True
    ):
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
        assert abs(output["reward"] - forward_reward(reward_model, ids)) <= 1e-5
        assert output["reward"] == answer["reward"]
        assert output["info"]["reward"]["reward_model"] == output["reward"]
    assert outputs[0]["reward"] != outputs[1]["reward"]


async def test_a_text_environment_reads_the_text_with_the_action(
    rewarded: httpx.AsyncClient, reward_model: torch.nn.Module, reward_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    created = await rewarded.post("/v1/envs", json={"reward": "model", "kind": "text"})
    env = created.json()["env_id"]
    await rewarded.post(f"/v1/envs/{env}/reset", json={"query": ["Q: 1+1? A:"]})
    step = await rewarded.post(f"/v1/envs/{env}/step", json={"actions": [{"text": " 2"}]})
    assert step.status_code == 200, step.text
    (output,) = step.json()["outputs"]
    ids = tokenizer("Q: 1+1? A: 2")["input_ids"]
    assert abs(output["reward"] - forward_reward(reward_model, ids)) <= 1e-5


async def test_reward_model_environments_are_refused_where_they_cannot_run(
    rewarded: httpx.AsyncClient, settings: Settings
) -> None:
    tokens = await rewarded.post("/v1/envs", json={"reward": "model", "kind": "tokens"})
    assert tokens.status_code == 422 and tokens.json()["error"]["param"] == "reward"
    async with served_app(settings.replace(models={"load_reference": False})) as plain:
        refused = await plain.post("/v1/envs", json={"reward": "model"})
    assert refused.status_code == 404 and "--reward-model" in refused.json()["error"]["message"]
