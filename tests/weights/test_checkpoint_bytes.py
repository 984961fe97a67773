"""`to_safetensors`: what a replica hands the ledger after a collective transfer reads back
exactly (safetensors' own reader), views into one received bucket included."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load

from app.weights.checkpoint import to_safetensors


def test_tensors_read_back_exactly_views_into_one_buffer_included() -> None:
    bucket = torch.arange(40, dtype=torch.uint8)
    state = {
        "a": bucket[:12].view(torch.float32),  # views sharing one bucket's memory
        "b": bucket[12:36].view(torch.float32).view(2, 3),
        "c": torch.tensor([True, False, True]),
        "d": torch.randn(3, 5).to(torch.bfloat16),
        "e": torch.empty(0, 4),
        "f": torch.randn(4, 6).t(),  # not contiguous
        "g": torch.arange(7, dtype=torch.int64),
    }
    back = load(to_safetensors(state))
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_an_empty_state_and_an_unknown_dtype() -> None:
    assert load(to_safetensors({})) == {}
    with pytest.raises(KeyError):
        to_safetensors({"x": torch.zeros(2, dtype=torch.complex64)})
