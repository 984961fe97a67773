"""PEFT adapters for the adapter tests, with random (non-zero) A and B, as trained ones have."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def peft_model(base_dir: Path, seed: int, **options: Any) -> PeftModel:
    """A PEFT adapter (LoraConfig `options`) of the model in `base_dir`, in float32."""
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(**options, init_lora_weights=False)).eval()
