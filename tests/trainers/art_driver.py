"""Drives ART's own client path (openpipe-art, unmodified) against the server at argv[1].

- argv[2] `capture` (ART 0.5.23): a `TrainableModel`'s OpenAI client (which adds
  return_token_ids, return_tokens_as_token_ids, nvext and chat_template_kwargs to every call),
  trajectories captured by `art.trajectory` / `art.trajectory_group`, the older
  `messages_and_choices` form gathered by `art.gather_trajectory_groups`, and ART's tokenizing
  of both for training.
- argv[2] `steps` RELEASE SOURCE FOLDER...: ART's loop across training steps, one step per
  adapter folder: the trainer pushes the step's LoRA adapter as the next version of the
  model's adapter (`POST /v1/load_lora_adapter`, the route ART's backend uses), then rollouts
  name the model as ART names each step's (`model.get_inference_name(step)`: NAME@STEP) and
  ART tokenizes the group for training as that release does: 0.5.18 reads the ids back from
  the log-prob tokens' names (`tokenize_trajectory_groups`, with the policy's tokenizer),
  0.5.23 from the exchanges it captured.

Prints what ART produced as JSON for tests/trainers/test_art.py to check. ART 0.5.23 runs in
.venv-art (it needs Python 3.12); 0.5.18, the newest release for Python 3.11, in
.venv-trainers from a folder of its own (scripts/setup-trainers.sh)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
import urllib.request
from typing import Any

import art

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


def tokenized(result: Any) -> dict[str, Any]:
    """One tokenized trajectory (0.5.23's): its tokens, which were sampled, and their
    log-probs (ART gives NaN for prompt tokens: null here)."""
    from art.trajectories import TokenFlag

    sampled = [i for i, flag in enumerate(result.flags) if flag & TokenFlag.SAMPLED]
    return {
        "tokens": list(result.tokens),
        "sampled": sampled,
        "logprobs": [None if math.isnan(v) else v for v in result.logprobs],
    }


def tokenized_0518(result: Any) -> dict[str, Any]:
    """One of 0.5.18's TokenizedResults, as `tokenized` says it."""
    return {
        "tokens": list(result.token_ids),
        "sampled": [i for i, mask in enumerate(result.assistant_mask) if mask],
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


def load_adapter(url: str, name: str, folder: str, again: bool) -> None:
    """The trainer's push of a step's adapter: the next version of adapter `name`."""
    body = {"lora_name": name, "lora_path": folder, "load_inplace": again}
    request = urllib.request.Request(
        f"{url}/v1/load_lora_adapter",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request) as answer:
        assert answer.status == 200


async def step_0518(client: Any, name: str, tokenizer: Any) -> list[dict[str, Any]]:
    """A group of four rollouts under `name` (0.5.18's way: the rollout builds its own
    trajectory), tokenized as 0.5.18's backend does for training."""
    from art.preprocessing.tokenize import tokenize_trajectory_groups

    async def rollout(i: int) -> art.Trajectory:
        response = await client.chat.completions.create(
            model=name,
            messages=MESSAGES,
            logprobs=True,
            max_tokens=8,
            temperature=1.0,
            seed=i,
            extra_body={"return_token_ids": True},  # (for the test: the ids it served)
        )
        return art.Trajectory(messages_and_choices=[*MESSAGES, response.choices[0]], reward=i)

    groups = [art.TrajectoryGroup(rollout(i) for i in range(4))]
    (gathered,) = await art.gather_trajectory_groups(groups, pbar_desc=None)
    results = tokenize_trajectory_groups(
        tokenizer,
        [gathered],
        allow_training_without_logprobs=False,
        scale_rewards=True,
        shuffle_group_trajectories=False,
        drop_zero_advantage_trajectories=False,
    )
    choices = [t.messages_and_choices[-1] for t in gathered.trajectories]
    return [
        {"served": (choice.model_extra or {}).get("token_ids"), **tokenized_0518(result)}
        for choice, result in zip(choices, results, strict=True)
    ]


async def step_0523(client: Any, name: str) -> list[dict[str, Any]]:
    """A group of four rollouts under `name`, captured by `art.trajectory_group` and
    tokenized as 0.5.23 does for training."""

    async def rollout(i: int) -> None:
        await client.chat.completions.create(
            model=name, messages=MESSAGES, logprobs=True, max_tokens=8, temperature=1.0, seed=i
        )
        art.current_trajectory(require=True).reward = float(i)

    group = await art.trajectory_group(art.trajectory(rollout(i)) for i in range(4))
    out = []
    for trajectory, result in zip(group.trajectories, group.tokenize().trajectories, strict=True):
        (exchange,) = trajectory.exchanges.chat_completions
        served = (exchange.response.choices[0].model_extra or {}).get("token_ids")
        out.append({"served": served, **tokenized(result)})
    return out


async def steps(url: str, release: str, source: str, folders: list[str]) -> dict[str, Any]:
    named = {"name": "agent", "project": "rlserve", "base_model": "rlserve/policy"}
    if release != "0.5.18":
        named["run_name"] = "test"  # (0.5.23 asks for one)
    model = art.TrainableModel(**named)
    model.inference_base_url, model.inference_api_key = f"{url}/v1", "unused"
    client = model.openai_client()
    out = []
    for step, folder in enumerate(folders):
        await asyncio.to_thread(load_adapter, url, model.name, folder, step > 0)
        name = model.get_inference_name(step)
        if release == "0.5.18":
            from transformers import AutoTokenizer

            rollouts = await step_0518(client, name, AutoTokenizer.from_pretrained(source))
        else:
            rollouts = await step_0523(client, name)
        out.append({"name": name, "trajectories": rollouts})
    return {"art": art.__file__, "steps": out}


if __name__ == "__main__":
    if sys.argv[2] == "steps":
        result = asyncio.run(steps(sys.argv[1], sys.argv[3], sys.argv[4], sys.argv[5:]))
    else:
        result = asyncio.run(main(sys.argv[1]))
    print(json.dumps(result))
