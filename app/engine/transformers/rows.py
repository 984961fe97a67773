"""Helpers of the decode loop shared with the prefix cache: each row's positions, the
adapters a forward runs with, a forward's returned cache, and the distinct prompts of a batch."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from app.engine.transformers.lora import LoraHooks
from app.engine.types import GenerateItem
from app.weights.lora import LoraAdapter


def adapted(
    lora: LoraHooks | None, adapters: Sequence[LoraAdapter | None]
) -> contextlib.AbstractContextManager[None]:
    """Forwards in this block run each row with its LoRA adapter
    (`app.engine.transformers.lora`)."""
    if lora is None:
        if any(a is not None for a in adapters):
            raise ValueError("a row asks for a LoRA adapter, but this model serves none")
        return contextlib.nullcontext()
    return lora.rows(adapters)


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Each column's position in its left-padded row (0 over the padding)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def returned_cache(out: Any) -> Any:
    """The cache a forward returned, under either of its names (see `cache_argument`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def distinct_prompts(
    items: Sequence[GenerateItem], device: torch.device
) -> tuple[list[int], torch.Tensor | None]:
    """The first row of each distinct prompt (and adapter), and each row's index among those
    (None when every prompt is distinct)."""
    first: dict[tuple[int, tuple[int, ...]], int] = {}
    firsts: list[int] = []
    index = []
    for row, item in enumerate(items):
        key = (id(item.adapter), tuple(item.prompt_ids))
        if key not in first:
            first[key] = len(firsts)
            firsts.append(row)
        index.append(first[key])
    if len(firsts) == len(items):
        return firsts, None
    return firsts, torch.tensor(index, dtype=torch.long, device=device)
