"""The ledger's record of a model's updates: a partial update merges over what came before
(so one checkpoint replays them all), a whole one replaces it."""

from __future__ import annotations

import torch
from safetensors.torch import load, save

from app.deploy.ledger import merged, tensor_names


def test_a_partial_update_merges_over_the_earlier_ones() -> None:
    first = {
        "a.safetensors": save({"x": torch.ones(2), "y": torch.zeros(3)}),
        "b.safetensors": save({"z": torch.ones(1, dtype=torch.bfloat16)}),
    }
    assert tensor_names(first) == {"x", "y", "z"}
    update = {"model.safetensors": save({"y": torch.arange(3.0)})}
    (data,) = merged(first, update).values()
    tensors = load(data)
    assert set(tensors) == {"x", "y", "z"}
    assert torch.equal(tensors["x"], torch.ones(2))
    assert torch.equal(tensors["y"], torch.arange(3.0))  # the later update wins
    assert tensors["z"].dtype == torch.bfloat16


def test_a_whole_update_replaces_the_record() -> None:
    first = {"a.safetensors": save({"x": torch.ones(2)})}
    whole = {"m.safetensors": save({"x": torch.zeros(2), "w": torch.ones(1)})}
    assert merged(first, whole) is whole
