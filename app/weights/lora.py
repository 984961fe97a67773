"""A LoRA adapter's weights as served: the layers it adapts, with their A and B matrices and
scaling, one version of them (`app.weights.lora_layout` reads them from PEFT's layout; the
engines apply them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class AdapterBuild:
    """What an engine builds one version of an adapter from: PEFT's config and tensors, and
    the name, version and source it is served under. An engine's refusal of it names the
    role `Role.ADAPTER_SOURCE`."""

    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    name: str
    version: int
    source: str


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear layer: A [r, in_features], B [out_features, r]."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float


@dataclass(eq=False)
class LoraAdapter:
    """An adapter as served: its name, one version of its tensors, and where they came from.
    Compared by identity: a new version is a new object, so rows in flight keep theirs."""

    name: str
    version: int
    source: str
    rank: int
    config: dict[str, Any] = field(repr=False)
    """PEFT's adapter config it was read with (a push of new tensors keeps it)."""
    modules: dict[str, LoraModule] = field(repr=False)
    """By the module's name in the served model (`model.layers.0.self_attn.q_proj`)."""

    def same_layout(self, other: LoraAdapter) -> bool:
        """Whether `other` adapts the same layers with matrices of the same shapes."""
        return self.modules.keys() == other.modules.keys() and all(
            m.a.shape == other.modules[k].a.shape and m.b.shape == other.modules[k].b.shape
            for k, m in self.modules.items()
        )

    @property
    def num_parameters(self) -> int:
        return sum(m.a.numel() + m.b.numel() for m in self.modules.values())
