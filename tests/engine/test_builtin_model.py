"""The built-in model: deterministic from its seed and loadable by plain transformers."""

from __future__ import annotations

import hashlib

from transformers import AutoModelForCausalLM, AutoTokenizer

from app.engine.builtin_model import build_model


def digest(directory) -> str:  # type: ignore[no-untyped-def]
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def test_same_seed_same_weights_other_seed_other_weights(tmp_path):
    a = build_model(tmp_path / "a", hidden_size=32, num_layers=1, seed=7)
    b = build_model(tmp_path / "b", hidden_size=32, num_layers=1, seed=7)
    c = build_model(tmp_path / "c", hidden_size=32, num_layers=1, seed=8)
    assert digest(a) == digest(b) != digest(c)
    model = AutoModelForCausalLM.from_pretrained(a)
    assert model.config.model_type == "qwen2"
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1


def test_byte_level_tokenizer_round_trips(model_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "naïve café ✓ <|im_start|>user"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids[: len("naïve".encode())] == list("naïve".encode())
    assert tokenizer.convert_ids_to_tokens(ids[-5]) == "<|im_start|>"
