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
