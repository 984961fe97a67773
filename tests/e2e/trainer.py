"""A trainer's side in tests: a real server on the built-in model without a reference, the
trainer's copy of the served policy, and a stand-in for a training step."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tests.e2e.server import Server, running_server


@contextmanager
def policy_server(tmp: Path) -> Iterator[Server]:
    """`rlserve serve` on the built-in model, data under `tmp`, no reference model."""
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    with running_server(env=env, log=tmp / "server.log") as server:
        yield server


def policy_source(client: Any) -> str:
    """The folder the server loaded its policy from (the server runs on this host)."""
    return str(next(m.source for m in client.models().models if m.name == "policy"))


def trainer_model(client: Any) -> torch.nn.Module:
    """The trainer's own copy of the served policy, in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_source(client), dtype=torch.float32)
    return model.eval()  # type: ignore[no-any-return]


def learn(model: torch.nn.Module, seed: int) -> None:
    """A stand-in for a training step: every weight moves a little."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.02)


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[tuple[list[int], list[list[int]], list[float]]],
) -> None:
    """One GRPO step on the trainer's model: per prompt, its completions and rewards; each
    completion's summed log-prob weighted by its group-normalised advantage."""
    optimizer.zero_grad()
    losses = []
    for prompt, completions, rewards in groups:
        r = torch.tensor(rewards)
        advantages = (r - r.mean()) / (r.std() + 1e-6)
        for completion, advantage in zip(completions, advantages, strict=True):
            if not completion:
                continue
            ids = torch.tensor([prompt + completion])
            log_probs = model(ids).logits[0, :-1].log_softmax(-1)
            taken = log_probs.gather(-1, ids[0, 1:, None]).squeeze(-1)[len(prompt) - 1 :]
            losses.append(-advantage * taken.sum())
    torch.stack(losses).mean().backward()
    optimizer.step()
