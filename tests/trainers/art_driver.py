"""Drives ART 0.5.23's own client path (openpipe-art, unmodified) against the server at
argv[1]: a `TrainableModel`'s OpenAI client (which adds return_token_ids,
return_tokens_as_token_ids, nvext and chat_template_kwargs to every call), trajectories
captured by `art.trajectory` / `art.trajectory_group`, the older `messages_and_choices` form
gathered by `art.gather_trajectory_groups`, and ART's tokenizing of both for training. Prints
what ART produced as JSON for tests/trainers/test_art.py to check. Runs in .venv-art (ART
needs Python 3.12)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from typing import Any

import art
from art.trajectories import TokenFlag

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def tokenized(result: Any) -> dict[str, Any]:
    """One tokenized trajectory: its tokens, which were sampled, and their log-probs (ART
    gives NaN for prompt tokens: null here)."""
    sampled = [i for i, flag in enumerate(result.flags) if flag & TokenFlag.SAMPLED]
    return {
        "tokens": list(result.tokens),
        "sampled": sampled,
        "logprobs": [None if math.isnan(v) else v for v in result.logprobs],
    }


def reply(response: Any) -> dict[str, Any]:
    choice = response.choices[0]
    extra = response.model_extra or {}
    return {
        "prompt_token_ids": extra.get("prompt_token_ids"),
        "token_ids": (choice.model_extra or {}).get("token_ids"),
        "logprobs": [c.logprob for c in choice.logprobs.content],
        "tokens": [c.token for c in choice.logprobs.content],
        "content": choice.message.content,
    }


async def main(url: str) -> dict[str, Any]:
    model = art.TrainableModel(
        name="policy", run_name="test", project="rlserve", base_model="rlserve/policy"
    )
    model.inference_base_url, model.inference_api_key = f"{url}/v1", "unused"
    client = model.openai_client()

    async def rollout(i: int) -> None:
        response = await client.chat.completions.create(
            model=model.get_inference_name(),
            messages=MESSAGES,  # type: ignore[arg-type]
            logprobs=True,
            max_tokens=8,
            temperature=1.0,
            seed=i,
        )
        art.current_trajectory(require=True).reward = float(i)
        del response

    group = await art.trajectory_group(art.trajectory(rollout(i)) for i in range(4))
    captured = []
    for trajectory, result in zip(group.trajectories, group.tokenize().trajectories, strict=True):
        (exchange,) = trajectory.exchanges.chat_completions
        captured.append({"reply": reply(exchange.response), **tokenized(result)})

    async def legacy(i: int) -> art.Trajectory:
        response = await client.chat.completions.create(
            model="policy",
            messages=MESSAGES,
            logprobs=True,
            max_tokens=8,
            seed=10 + i,  # type: ignore[arg-type]
        )
        return art.Trajectory(messages_and_choices=[*MESSAGES, response.choices[0]], reward=1.0)

    groups = [art.TrajectoryGroup(legacy(i) for i in range(2))]
    (gathered,) = await art.gather_trajectory_groups(groups, pbar_desc=None)
    old = [tokenized(r) for r in gathered.tokenize(model="policy").trajectories]
    choices = [t.messages_and_choices[-1] for t in gathered.trajectories]
    return {
        "captured": captured,
        "legacy": [
            {"token_ids": (c.model_extra or {}).get("token_ids"), **tokens}
            for c, tokens in zip(choices, old, strict=True)
        ],
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
