"""An uploaded dataset drives a GRPO rollout end to end on the built-in model: each episode's
prompt comes from the dataset, the ifeval reward checks that row's own instructions, and the
rewards and group advantages match an independent computation from the sampled text."""

from __future__ import annotations

import json
import re
import uuid

import pytest
import torch

from app.envs import ifeval
from tests.conftest import assert_close

pytestmark = pytest.mark.skipif(ifeval.unavailable() is not None, reason="ifeval extra")

ROWS = [
    {
        "text": "Write anything with the letter e at least twice.",
        "checks": ["keywords:letter_frequency"],
        "args": [{"letter": "e", "let_frequency": 2, "let_relation": "at least"}],
    },
    {
        "text": "Write fewer than 4 words.",
        "checks": ["length_constraints:number_words"],
        "args": [{"num_words": 4, "relation": "less than"}],
    },
]


def follows(row: dict[str, object], response: str) -> bool:
    """IFEval's strict check of these two instructions, written out: a non-empty response;
    letter counts over the lowercased text; words as runs of \\w characters."""
    if not response.strip():
        return False
    if row["checks"] == ["keywords:letter_frequency"]:
        return response.lower().count("e") >= 2
    return len(re.findall(r"\w+", response)) < 4


async def test_an_uploaded_dataset_drives_a_grpo_rollout(client, hf_tokenizer):
    name = f"inst-{uuid.uuid4().hex[:8]}"
    body = {
        "name": name,
        "jsonl": "\n".join(json.dumps(r) for r in ROWS),
        "fields": {
            "query": "text",
            "answer": None,
            "extra": {"instruction_id_list": "checks", "kwargs": "args"},
        },
        "reward": "ifeval",
    }
    uploaded = await client.post("/v1/datasets", json=body)
    assert uploaded.status_code == 201, uploaded.text
    # strict accuracy only, no tag bonuses, the whole response checked: reward = 2·followed
    options = {
        "format_weights": [1, 1, 0, 0],
        "answer_bonus": 0,
        "think_bonus": 0,
        "scored": "response",
    }
    env = {
        "dataset": name,
        "reward": "ifeval",
        "reward_options": options,
        "batch_size": 4,
        "repeats": 4,
        "max_turns": 1,
        "seed": 0,
    }
    generation = {"max_new_tokens": 12, "seed": 4, "temperature": 1.0}
    out = await client.post(
        "/v1/rollouts", json={"env": env, "num_episodes": 16, "generation": generation}
    )
    assert out.status_code == 200, out.text
    trajectories = out.json()["trajectories"]
    assert [t["group"] for t in trajectories] == [i // 4 for i in range(16)]
    by_query = {r["text"]: r for r in ROWS}
    rewards = []
    for trajectory in trajectories:
        (step,) = trajectory["steps"]
        query = trajectory["history"][0]["content"]
        row = by_query[query]  # every prompt is a row of the upload
        assert step["info"]["reward"]["instruction_id_list"] == row["checks"]
        # rewards read the reply's text without special tokens (the tokens' own text has them)
        text = hf_tokenizer.decode(step["tokens"]["response"], skip_special_tokens=True)
        assert step["reward"] == 2.0 * follows(row, text)
        rewards.append(step["reward"])
    assert {t["history"][0]["content"] for t in trajectories} == set(by_query)
    grouped = torch.tensor(rewards, dtype=torch.float64).view(4, 4)
    mean, std = grouped.mean(1, keepdim=True), grouped.std(1, keepdim=True).clamp_min(1e-6)
    expected = ((grouped - mean) / std).flatten().tolist()
    assert_close([t["advantage"] for t in trajectories], expected, 1e-9)
    assert len(set(rewards)) == 2  # both outcomes occur: the check above is not vacuous
    assert (await client.delete(f"/v1/datasets/{name}")).status_code == 204
