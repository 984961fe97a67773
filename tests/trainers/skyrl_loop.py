"""SkyRL's training loop around its own client calls, for the SkyRL drivers (run in
.venv-skyrl): each step generates groups as SkyRL's generator asks (`min_tokens` 1, the
server's stop id, raw log-probs), takes a GRPO step on the trainer's copy of the policy, and
pushes the new weights with the driver's weight sync (SkyRL's own code). Every step records
the log-probs the server sampled with and the trainer's forward of the same tokens on the
weights it pushed last; the end, the trainer's forward of a few sequences."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from tests.e2e.trainer import grpo_step

PROMPTS = [[5, 6, 7, 8], [40, 41]]
GROUP = 4
SEQUENCES = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43]]

Generate = Callable[[list[list[int]], dict[str, Any]], Awaitable[dict[str, Any]]]
Push = Callable[[list[tuple[str, torch.Tensor]]], Awaitable[None]]


def own_log_probs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> list[float]:
    """The trainer's forward: each completion token's log-prob."""
    with torch.no_grad():
        ids = torch.tensor([prompt + completion])
        logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        return logits.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1).tolist()  # type: ignore[no-any-return]


def sampling_params(stop_id: int, max_tokens: int) -> dict[str, Any]:
    """What SkyRL's generator sends (skyrl/train/generators/utils.py: get_sampling_params,
    as SkyRL's configs set it)."""
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "min_tokens": 1,
        "skip_special_tokens": True,
        "include_stop_str_in_output": True,
        "logprobs": 0,
        "stop_token_ids": [stop_id],
    }


async def three_steps(source: str, stop_id: int, generate: Generate, push: Push) -> dict[str, Any]:
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = sampling_params(stop_id, 6)
    steps = []
    for _ in range(3):
        prompts = [prompt for prompt in PROMPTS for _ in range(GROUP)]  # SkyRL repeats, n = 1
        out = await generate(prompts, params)
        own = [
            own_log_probs(model, p, ids)
            for p, ids in zip(prompts, out["response_ids"], strict=True)
        ]
        steps.append({"sampled": out["response_logprobs"], "own": own, "ids": out["response_ids"]})
        groups = []
        for i, prompt in enumerate(PROMPTS):
            replies = out["response_ids"][i * GROUP : (i + 1) * GROUP]
            rewards = [sum(t % 2 == 0 for t in reply) / len(reply) for reply in replies]
            groups.append((prompt, replies, rewards))
        model.train()
        grpo_step(model, optimizer, groups)
        model.eval()
        await push([(name, t.detach().contiguous()) for name, t in model.state_dict().items()])
    final = [own_log_probs(model, s[:1], s[1:]) for s in SEQUENCES]
    return {"steps": steps, "final": {"sequences": SEQUENCES, "own": final}}
