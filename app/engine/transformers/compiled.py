"""Decoding steps through `torch.compile`, over a static key/value cache (opt-in:
`models.compile_decode`).

transformers' own recipe for fast decoding: a `StaticCache` (the keys and values preallocated for
the whole generation, updated in place) and the model's forward compiled once with dynamic
shapes (`model.get_compiled_call`). On CUDA the compiled step is also captured as CUDA graphs
(mode "reduce-overhead"), so a step costs one graph launch instead of a few hundred kernel
launches from Python. To keep the graphs few and their memory bounded there, the batch is padded
to a power of two (the padding rows repeat the last real row) and the cache length to a multiple
of `GRAPH_LENGTH_STEP`, and the caches of the last `POOLED_CACHES` shapes are kept: a graph reads
the cache at the address it was captured with.

Prefill and the cache rebuild after a keep-mode weight swap run eagerly into the same cache.
Rows with LoRA adapters and calls that record routed experts decode eagerly (forward hooks do not
run under CUDA graphs); so do models whose cache is not plain full attention (sliding windows,
linear attention), where the static layers' shapes differ by layer."""

from __future__ import annotations

import inspect
import logging
import threading
from collections import OrderedDict
from typing import Any

import torch

logger = logging.getLogger(__name__)

GRAPH_LENGTH_STEP = 256
"""With CUDA graphs, cache lengths are rounded up to a multiple of this."""

POOLED_CACHES = 2
"""With CUDA graphs, the static caches of this many recent shapes are kept for reuse."""


def _bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << (rows - 1).bit_length()


class CompiledDecode:
    """The compiled decode step of one model, and its static caches."""

    def __init__(self, model: Any, *, graphs: bool | None = None) -> None:
        self.model = model
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        """CUDA graphs: the batch and the cache length padded to a few shapes, caches pooled."""
        self._compiled: Any = None
        self._caches: OrderedDict[tuple[int, int], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._failed = False
        self._proven = False
        self.steps = 0
        """Compiled steps run so far."""
        parameters = inspect.signature(getattr(model, "forward", model)).parameters
        self._cache_argument = "cache" if "cache" in parameters else "past_key_values"
        self._takes_cache_position = "cache_position" in parameters

    def usable(self) -> bool:
        """Whether this model's decode can run compiled: a cache of full-attention layers only,
        and no compile has failed on it."""
        if self._failed:
            return False
        layer_types = getattr(self.model.config, "layer_types", None)
        if layer_types and any(t != "full_attention" for t in layer_types):
            return False
        return not getattr(self.model.config, "sliding_window", None) or not getattr(
            self.model.config, "use_sliding_window", True
        )

    def _step_call(self) -> Any:
        if self._compiled is None:
            mode = "reduce-overhead" if self.graphs else "default"
            compiled_call = getattr(self.model, "get_compiled_call", None)
            if compiled_call is not None:
                from transformers.generation.configuration_utils import CompileConfig

                self._compiled = compiled_call(CompileConfig(mode=mode, dynamic=True))
            else:
                self._compiled = torch.compile(self.model.__call__, mode=mode, dynamic=True)
        return self._compiled

    def _cache(self, rows: int, length: int) -> Any:
        from transformers import StaticCache

        if not self.graphs:
            return StaticCache(config=self.model.config, max_cache_len=length)
        with self._lock:
            cache = self._caches.pop((rows, length), None)
            if cache is None:
                while len(self._caches) >= POOLED_CACHES:
                    self._caches.popitem(last=False)
                cache = StaticCache(config=self.model.config, max_cache_len=length)
            else:
                cache.reset()
            self._caches[(rows, length)] = cache
            return cache

    def begin(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> StaticRun:
        """A generation over left-padded prompts `ids` [B, W] (`mask` their attention mask) of
        at most `new_tokens` tokens."""
        rows, width = ids.shape
        padded_rows = _bucket(rows) if self.graphs else rows
        length = width + new_tokens
        if self.graphs:
            length = -(-length // GRAPH_LENGTH_STEP) * GRAPH_LENGTH_STEP
        return StaticRun(self, self._cache(padded_rows, length), ids, mask, padded_rows, length)

    def failed(self, error: BaseException) -> None:
        """The first compiled step raised (the model's forward does not compile): this model
        decodes eagerly from now on."""
        logger.warning("compiled decoding failed; decoding eagerly from now on: %r", error)
        self._failed = True


class StaticRun:
    """One generation's prefill, steps and rebuilds over a static cache. Every tensor handed to
    the model has the padded batch (`rows`); the logits returned have the real rows alone."""

    def __init__(
        self,
        owner: CompiledDecode,
        cache: Any,
        ids: torch.Tensor,
        mask: torch.Tensor,
        rows: int,
        length: int,
    ) -> None:
        self.owner = owner
        self.cache = cache
        self.real = ids.shape[0]
        self.width = ids.shape[1]
        self._pad = torch.cat(
            [
                torch.arange(self.real, device=ids.device),
                torch.full((rows - self.real,), self.real - 1, device=ids.device),
            ]
        )
        self.ids = ids.index_select(0, self._pad)
        # The whole cache's mask, fixed for the run: the prompts' padding masked, every later
        # position open (the causal mask hides those not yet written).
        self.mask = torch.ones((rows, length), dtype=mask.dtype, device=mask.device)
        self.mask[:, : self.width] = mask.index_select(0, self._pad)
        self.written = 0

    def _call(
        self, fn: Any, input_ids: torch.Tensor, position_ids: torch.Tensor, **options: Any
    ) -> Any:
        """`fn` (the model, or its compiled call) over `input_ids` written after what the cache
        holds. An eager call sees the mask up to its last position; the compiled step sees the
        whole mask, one shape for the run."""
        end = self.written + input_ids.shape[1]
        if self.owner._takes_cache_position:
            options["cache_position"] = torch.arange(self.written, end, device=input_ids.device)
        out = fn(
            input_ids=input_ids,
            attention_mask=self.mask if fn is not self.owner.model else self.mask[:, :end],
            position_ids=position_ids,
            use_cache=True,
            **{self.owner._cache_argument: self.cache},
            **options,
        )
        self.written = end
        return out

    def prefill(self, positions: torch.Tensor, keep_all: bool) -> torch.Tensor:
        """The prompts into the cache, eagerly; their logits ([B, W or 1, V])."""
        out = self._call(
            self.owner.model,
            self.ids,
            positions.index_select(0, self._pad),
            logits_to_keep=0 if keep_all else 1,
        )
        return out.logits[: self.real]

    def step(self, chosen: torch.Tensor, position: torch.Tensor) -> torch.Tensor | None:
        """One token per row through the compiled step; the next logits [B, V] in float32.
        None where the model's first compiled step failed (see `CompiledDecode.failed`)."""
        call = self.owner._step_call()
        if self.owner.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            out = self._call(
                call,
                chosen.index_select(0, self._pad)[:, None],
                position.index_select(0, self._pad),
            )
        except Exception as error:
            if self.owner._proven:
                raise
            self.owner.failed(error)
            return None
        self.owner._proven = True
        self.owner.steps += 1
        # A graph's output is overwritten by its next replay: the logits are copied out.
        return out.logits[: self.real, -1].float().clone()

    def rebuild(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Everything so far ([B, T]) into the emptied cache, eagerly (the weights changed); the
        last position's logits [B, V] in float32."""
        self.cache.reset()
        self.written = 0
        out = self._call(
            self.owner.model,
            ids.index_select(0, self._pad),
            positions.index_select(0, self._pad),
            logits_to_keep=1,
        )
        return out.logits[: self.real, -1].float()
