"""`dtype=auto` is resolved once from the checkpoint, the same for every backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.engine.loader import resolve_dtype


def checkpoint(tmp_path: Path, dtype: str | None) -> str:
    config = {"model_type": "qwen2", "vocab_size": 300, "hidden_size": 64}
    if dtype is not None:
        config["torch_dtype"] = dtype
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("stored", "cuda", "expected"),
    [
        ("float32", False, "float32"),
        ("float32", True, "float32"),
        ("bfloat16", False, "bfloat16"),
        ("bfloat16", True, "bfloat16"),
        ("float16", True, "float16"),
        ("float16", False, "float32"),  # half precision runs as float32 on CPU
        (None, False, "float32"),
    ],
)
def test_auto_follows_the_checkpoint(tmp_path, stored, cuda, expected):
    source = checkpoint(tmp_path, stored)
    assert resolve_dtype("auto", source, cuda=cuda, trust_remote_code=False) == expected


def test_an_explicit_dtype_wins(tmp_path):
    source = checkpoint(tmp_path, "bfloat16")
    assert resolve_dtype("float32", source, cuda=False, trust_remote_code=False) == "float32"


def test_the_builtin_model_is_served_in_float32(model_dir):
    assert resolve_dtype("auto", str(model_dir), cuda=False, trust_remote_code=False) == "float32"
