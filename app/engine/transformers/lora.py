"""LoRA adapters applied per row: rows of several adapters, and rows of the base model, share
one forward. The served model is never modified: a forward hook on each adapted linear layer
adds, to the rows of each adapter, `scaling * B(A(x))`, the term PEFT's LoRA layers add in
evaluation (dropout off). The base model's parameters, their names and its checkpoint layout
stay what they were, so full-weight updates work as before and the base is the adapter off."""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.nn import functional as F

from app.weights.lora import LoraAdapter

STACKED_MAX_TOKENS = 4
"""A forward of at most this many tokens per row (a decoding step) with rows of several
adapters adds them all at once (`_Assignment.layer`); a longer one (a prefill, a scoring
pass), adapter by adapter, as PEFT's mixed batches do."""


class _Assignment:
    """Which adapter each row of a batch uses: the rows of each adapter (`plan`, for a pass
    adapter by adapter; None for an adapter on every row), and for a mixed batch its adapters
    side by side per layer (`layer`): A of every adapter stacked [R, in], B [out, R], and per
    row its own adapter's block of the R ranks, scaled (zero elsewhere). A decoding step then
    adds every row's term with two matrix products per layer, however many adapters its rows
    use (instead of two per adapter); a row of the base gets exactly zero. Built once for a
    batch and kept while the same rows decode."""

    def __init__(self, adapters: tuple[LoraAdapter | None, ...], device: torch.device) -> None:
        self.adapters = adapters
        self.device = device
        groups: dict[LoraAdapter, list[int]] = {}
        for row, adapter in enumerate(adapters):
            if adapter is not None:
                groups.setdefault(adapter, []).append(row)
        everyone = len(groups) == 1 and len(next(iter(groups.values()))) == len(adapters)
        self.plan = [
            (adapter, None if everyone else torch.tensor(rows, device=device))
            for adapter, rows in groups.items()
        ]
        self.mixed = not everyone
        """Rows of several adapters, or of adapters and the base."""
        self._layers: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}

    def layer(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        if name not in self._layers:
            self._layers[name] = self._stack(name)
        return self._layers[name]

    def _stack(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        blocks = {a: a.modules[name] for a, _ in self.plan if name in a.modules}
        if not blocks:
            return None
        a = torch.cat([m.a for m in blocks.values()])
        b = torch.cat([m.b for m in blocks.values()], dim=1)
        spans, start = {}, 0
        for adapter, lora in blocks.items():
            spans[adapter] = (start, start + lora.a.shape[0], lora.scaling)
            start += lora.a.shape[0]
        weights = torch.zeros(len(self.adapters), start, dtype=a.dtype)
        for row, chosen in enumerate(self.adapters):
            if chosen in spans:
                begin, end, scaling = spans[chosen]
                weights[row, begin:end] = scaling
        return a, b, weights.to(self.device)


class LoraHooks:
    """The hooks on a model's adapted layers, and which adapter each row of the current forward
    uses (`rows`). Forwards run on the model's one worker thread; the assignment is that
    thread's, so a forward elsewhere (a weight transfer's checks) sees the base."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._hooked: set[str] = set()
        self._local = threading.local()
        # the last two batches' assignments (a generation's decoding steps reuse theirs;
        # bounded, since a mixed one holds a copy of its adapters' matrices once stacked);
        # changed on the model thread and by `forget` (the loop's), hence the lock
        self._assignments: OrderedDict[tuple[LoraAdapter | None, ...], _Assignment] = OrderedDict()
        self._lock = threading.Lock()

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
        if all(adapter is None for adapter in adapters):
            yield
            return
        key = tuple(adapters)
        with self._lock:
            assignment = self._assignments.pop(key, None)
        if assignment is None:
            assignment = _Assignment(key, next(self.model.parameters()).device)
        with self._lock:
            self._assignments[key] = assignment
            while len(self._assignments) > 2:
                self._assignments.popitem(last=False)
        self._local.plan = assignment
        try:
            yield
        finally:
            self._local.plan = None

    def forget(self, adapter: LoraAdapter) -> None:
        """Drop the kept assignments that name `adapter` (no longer served): a forward in
        flight keeps its own, and a later one naming it builds it again."""
        with self._lock:
            for key in [k for k in self._assignments if adapter in k]:
                del self._assignments[key]

    def _hook(self, name: str) -> Any:
        def add_adapters(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            assignment: _Assignment | None = getattr(self._local, "plan", None)
            if assignment is None:
                return None
            x = args[0]
            if x.shape[0] != len(assignment.adapters):
                raise RuntimeError(
                    f"LoRA on {name}: its input has {x.shape[0]} rows, not the batch's "
                    f"{len(assignment.adapters)} (this architecture does not keep rows apart there)"
                )
            if assignment.mixed and x.dim() == 3 and x.shape[1] <= STACKED_MAX_TOKENS:
                layer = assignment.layer(name)
                if layer is None:
                    return None
                a, b, weights = layer
                delta = F.linear(F.linear(x.to(a.dtype), a) * weights[:, None, :], b)
                return output + delta.to(output.dtype)
            for adapter, rows in assignment.plan:
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
