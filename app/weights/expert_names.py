"""A mixture-of-experts model's weights under its checkpoint's names as well as its own.

transformers 5 keeps each MoE layer's experts fused (`mlp.experts.gate_up_proj`,
`[experts, 2 * intermediate, hidden]`) and converts the hub's per-expert tensors
(`mlp.experts.3.gate_proj.weight`) as it loads a checkpoint. Trainers push either layout: one
exporting for vLLM or SGLang sends the hub's names (slime, AReaL), one holding a transformers
model sends its state dict. `checkpoint_views` names both, the per-expert ones as views into
the fused tensors, so an update written under either name lands in the same memory.

The mapping is transformers' own for the model type (`conversion_mapping`); the conversions
read here are the experts' merges (a list of experts stacked on dim 0, gate and up then
concatenated on dim 1) and literal renamings (Mixtral's `block_sparse_moe` is `mlp`). A model
whose mapping holds nothing else of these has no other names."""

from __future__ import annotations

import functools
import re
from typing import Any

import torch


def checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict, plus each fused expert tensor's per-expert parts under the
    checkpoint's names (views: writing one writes the model's weight)."""
    state: dict[str, torch.Tensor] = model.state_dict()
    merges, renamings = _conversions(getattr(getattr(model, "config", None), "model_type", None))
    if not merges and not renamings:
        return state
    views = dict(state)
    for sources, target, concatenated in merges:
        for name, fused in state.items():
            if not (name == target or name.endswith("." + target)):
                continue
            prefix = name[: len(name) - len(target)]
            parts = fused.chunk(len(sources), dim=1) if concatenated else (fused,)
            for source, part in zip(sources, parts, strict=True):
                for expert in range(fused.shape[0]):
                    views[prefix + source.replace("*", str(expert))] = part[expert]
    for own, checkpoint in renamings:  # the checkpoint's names of every tensor renamed
        for name, tensor in list(views.items()):
            if own in name:
                views.setdefault(name.replace(own, checkpoint), tensor)
    return views


_LITERAL = re.compile(r"\.?\w+(\.\w+)*\.?")


@functools.cache
def _conversions(
    model_type: str | None,
) -> tuple[list[tuple[list[str], str, bool]], list[tuple[str, str]]]:
    """The model type's expert merges (source patterns, target, gate and up concatenated) and
    literal renamings (the model's name part, the checkpoint's); read once per model type
    (transformers builds a deep copy of its mapping on every call)."""
    if model_type is None:
        return [], []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
        )
    except ImportError:  # a transformers without conversions loads checkpoints as they are
        return [], []
    merges: list[tuple[list[str], str, bool]] = []
    renamings: list[tuple[str, str]] = []
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        sources = [p.lstrip(".") for p in conversion.source_patterns]
        targets = [p.lstrip(".") for p in conversion.target_patterns]
        if isinstance(conversion, WeightConverter):
            ops: list[Any] = list(conversion.operations)
            merged = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            rest = ops[1:]
            concatenated = len(rest) == 1 and isinstance(rest[0], Concatenate)
            if (
                merged
                and len(targets) == 1
                and all(s.count("*") == 1 for s in sources)
                and (not rest or (concatenated and rest[0].dim == 1))
            ):
                merges.append((sources, targets[0], concatenated))
        elif isinstance(conversion, WeightRenaming) and len(sources) == len(targets) == 1:
            source, target = conversion.source_patterns[0], conversion.target_patterns[0]
            if _LITERAL.fullmatch(source) and _LITERAL.fullmatch(target):
                renamings.append((target, source))
    return merges, renamings
