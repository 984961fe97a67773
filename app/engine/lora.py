"""LoRA adapters applied per row: rows of several adapters, and rows of the base model, share
one forward. The served model is never modified: a forward hook on each adapted linear layer
adds, to the rows of each adapter, `scaling * B(A(x))`, the term PEFT's LoRA layers add in
evaluation (dropout off). The base model's parameters, their names and its checkpoint layout
stay what they were, so full-weight updates work as before and the base is the adapter off."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn import functional as F


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


class LoraHooks:
    """The hooks on a model's adapted layers, and which adapter each row of the current forward
    uses (`rows`). Forwards run on the model's one worker thread; the assignment is that
    thread's, so a forward elsewhere (a weight transfer's checks) sees the base."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._hooked: set[str] = set()
        self._local = threading.local()

    def install(self, adapter: LoraAdapter) -> None:
        """Hook the layers `adapter` adapts (once per layer; hooks stay: an adapter may be
        unloaded while rows in flight still use it, and an unused hook costs one call)."""
        for name in adapter.modules:
            if name not in self._hooked:
                module = self.model.get_submodule(name)
                module.register_forward_hook(self._hook(name))
                self._hooked.add(name)

    @contextlib.contextmanager
    def rows(self, adapters: Sequence[LoraAdapter | None]) -> Iterator[None]:
        """Forwards in this block run row i with `adapters[i]` (None: the base model)."""
        groups: dict[int, tuple[LoraAdapter, list[int]]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(row)
        if not groups:
            yield
            return
        device = next(self.model.parameters()).device
        plan = [
            (adapter, None if len(rows) == len(adapters) else torch.tensor(rows, device=device))
            for adapter, rows in groups.values()
        ]
        self._local.plan = (len(adapters), plan)
        try:
            yield
        finally:
            self._local.plan = None

    def _hook(self, name: str) -> Any:
        def add_adapters(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            current = getattr(self._local, "plan", None)
            if current is None:
                return None
            batch, plan = current
            x = args[0]
            if x.shape[0] != batch:
                raise RuntimeError(
                    f"LoRA on {name}: its input has {x.shape[0]} rows, not the batch's {batch} "
                    "(this architecture does not keep rows apart there)"
                )
            for adapter, rows in plan:
                lora = adapter.modules.get(name)
                if lora is None:
                    continue
                # PEFT's arithmetic, rounding included: the LoRA term in the adapter's dtype
                # (float32 on a half-precision model), added as PEFT adds it.
                if rows is None:  # every row: PEFT's forward with one active adapter
                    delta = F.linear(F.linear(x.to(lora.a.dtype), lora.a), lora.b) * lora.scaling
                    output = (output + delta).to(output.dtype)
                else:  # PEFT's mixed-batch forward (`adapter_names`)
                    sub = x[rows].to(lora.a.dtype)
                    delta = F.linear(F.linear(sub, lora.a), lora.b) * lora.scaling
                    output = output.index_add(0, rows, delta.to(output.dtype))
            return output

        return add_adapters
