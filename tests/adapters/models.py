"""PEFT adapters for the adapter tests, with random (non-zero) A and B, as trained ones have;
and what the served log-probs of an adapter are checked against: PEFT's own forward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.conftest import assert_close, forward_log_probs

SEQUENCES = [[1, 5, 9, 13, 22, 7, 3], [4, 4, 8, 100, 2], [17, 30, 41, 52, 63, 74, 85, 96]]


def peft_model(base_dir: Path, seed: int, **options: Any) -> PeftModel:
    """A PEFT adapter (LoraConfig `options`) of the model in `base_dir`, in float32."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(**options, init_lora_weights=False)).eval()


async def log_probs(client: httpx.AsyncClient, model: str) -> list[list[float]]:
    """The log-probs `model` (an adapter's name) serves for `SEQUENCES`."""
    response = await client.post("/v1/logprobs", json={"model": model, "tokens": SEQUENCES})
    assert response.status_code == 200, response.text
    return [output["log_probs"]["full"] for output in response.json()["outputs"]]


def assert_peft(served: list[list[float]], model: torch.nn.Module) -> None:
    """`served` (for `SEQUENCES`) is what the PEFT `model` computes."""
    for sequence, values in zip(SEQUENCES, served, strict=True):
        assert_close(values, forward_log_probs(model, sequence), 1e-4)
