"""A mixture-of-experts model's weights under its checkpoint's names: every tensor
transformers' own save_pretrained writes (per expert, Mixtral's block_sparse_moe names
included) is named, holds the same values, and writing it writes the model's fused weight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2Config, Qwen3MoeConfig

from app.weights.expert_names import checkpoint_views

SMALL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 50,
}
CONFIGS = {
    "qwen3_moe": Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8
    ),
    "mixtral": MixtralConfig(
        **SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
    ),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_saved_tensor_is_a_view_of_the_served_weights(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family]).eval()
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    views = checkpoint_views(model)
    assert any(".experts.0." in name for name in saved)  # the checkpoint is per expert
    assert sorted(set(saved) - set(views)) == []
    for name, tensor in saved.items():
        assert torch.equal(views[name], tensor), name
    up = "block_sparse_moe.experts.1.w3" if family == "mixtral" else "mlp.experts.1.up_proj"
    name = f"model.layers.0.{up}.weight"  # expert 1's up projection, in layer 0
    with torch.no_grad():
        views[name].fill_(7.0)
    fused = next(
        p for n, p in model.named_parameters() if n.endswith("layers.0.mlp.experts.gate_up_proj")
    )
    half = fused.shape[1] // 2
    assert bool((fused[1, half:] == 7.0).all()) and not bool((fused[1, :half] == 7.0).any())


def test_a_dense_model_has_its_own_names_only() -> None:
    model = AutoModelForCausalLM.from_config(Qwen2Config(**SMALL, intermediate_size=16))
    assert checkpoint_views(model).keys() == model.state_dict().keys()
