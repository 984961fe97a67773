"""Decoding steps through `torch.compile`, over a static key/value cache (opt-in:
`models.compile_decode`).

transformers' own recipe for fast decoding: a `StaticCache` (the keys and values preallocated for
the whole generation, updated in place) and the model's forward compiled once with dynamic
shapes (as `generate` does through `model.get_compiled_call`; here with inductor's
`emulate_precision_casts`, so that bfloat16 kernels round as eager ones do: on the tiny model in
bfloat16 sampled log-probs were 0.14 from `/v1/logprobs` without it, 0.020 with it and 0.034
eager). On CUDA the compiled step is also captured as CUDA graphs (what mode "reduce-overhead"
turns on), so a step costs one graph launch instead of a few hundred kernel launches from
Python. To keep the graphs few and their memory bounded there, the batch is padded
to a power of two (the padding rows repeat the last real row) and the cache length to a multiple
of `GRAPH_LENGTH_STEP`, and the last shape's cache is kept for the next generation of that shape:
a graph reads the cache at the address it was captured with (and weight updates copy into the
parameters in place, `app.weights.staging.adopt`, for the same reason). The padding costs memory:
a static cache holds up to twice the rows `batching.max_batch_tokens` counts, at the padded
length, from the first step.

The prefill runs eagerly, as without compiling (a prompt shared by several rows prefilled once),
and its keys and values are then written into the static cache; the cache rebuild after a
keep-mode weight swap runs eagerly into the static cache.
Models with LoRA adapters or MoE routers decode eagerly (their forward hooks are Python, which
CUDA graphs do not replay); so do models whose cache is not plain full attention (sliding windows,
linear attention), where the static layers' shapes differ by layer."""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

GRAPH_LENGTH_STEP = 256
"""With CUDA graphs, cache lengths are rounded up to a multiple of this."""


def cache_argument(model: Any) -> str:
    """The forward's name for the key/value cache: transformers 5.24 renamed `past_key_values`
    (the old name still works there, with a deprecation warning) to `cache`."""
    forward = getattr(model, "forward", model)
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _compilable(model: Any) -> bool:
    """A model transformers marks as compilable whole, with a cache of full-attention layers
    only (a static cache's layers then have one shape)."""
    if not getattr(model, "_can_compile_fullgraph", False):
        return False
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    sliding = getattr(config, "sliding_window", None)
    return not sliding or not getattr(config, "use_sliding_window", True)


def _bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << (rows - 1).bit_length()


class CompiledDecode:
    """The compiled decode step of one model, and its static caches."""

    def __init__(self, model: Any, *, graphs: bool | None = None) -> None:
        self.model = model
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        """CUDA graphs: the batch and the cache length padded to a few shapes, the last
        shape's cache kept."""
        self._compiled: Any = None
        self._kept: tuple[tuple[int, int], Any] | None = None  # (shape, cache), with graphs
        self._failed = False
        self.steps = 0
        """Compiled steps run so far."""
        self._cache_argument = cache_argument(model)
        self._compilable = _compilable(model)

    def usable(self) -> bool:
        """Whether this model's decode can run compiled (`_compilable`), no compile having
        failed on it."""
        return self._compilable and not self._failed

    def _step_call(self) -> Any:
        if self._compiled is None:
            # Fused bfloat16/float16 kernels round like eager ones (each operation's result
            # rounded to the dtype), so decoding's log-probs stay as close to scoring's; CUDA
            # graphs are what mode "reduce-overhead" turns on.
            options = {"emulate_precision_casts": True, "triton.cudagraphs": self.graphs}
            self._compiled = torch.compile(
                self.model.__call__, dynamic=True, fullgraph=False, options=options
            )
        return self._compiled

    def _cache(self, rows: int, length: int) -> Any:
        from transformers import StaticCache

        if self.graphs and self._kept is not None and self._kept[0] == (rows, length):
            cache = self._kept[1]
            cache.reset()
            return cache
        self._kept = None  # freed before the next one is allocated
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        if self.graphs:
            self._kept = ((rows, length), cache)
        return cache

    def begin(
        self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, prefilled: Any
    ) -> StaticRun:
        """A generation over left-padded prompts `ids` [B, W] (`mask` their attention mask) of
        at most `new_tokens` tokens, whose prompts' keys and values are in `prefilled` (the
        eager prefill's cache, one row per row of `ids`)."""
        rows, width = ids.shape
        padded_rows = _bucket(rows) if self.graphs else rows
        length = width + new_tokens
        if self.graphs:
            length = -(-length // GRAPH_LENGTH_STEP) * GRAPH_LENGTH_STEP
        cache = self._cache(padded_rows, length)
        return StaticRun(self, cache, prefilled, ids, mask, padded_rows, length)

    def failed(self, error: BaseException) -> None:
        """A compiled step, or a prefill into a static cache, raised: this model decodes
        eagerly from now on; on running out of memory, only this generation does."""
        self._kept = None
        if isinstance(error, torch.OutOfMemoryError):
            logger.warning("compiled decoding ran out of memory; this generation goes on eagerly")
            return
        logger.warning("compiled decoding failed; decoding eagerly from now on: %r", error)
        self._failed = True


class StaticRun:
    """One generation's steps and rebuilds over a static cache. Every tensor handed to the
    model has the padded batch (`rows`); the logits returned have the real rows alone."""

    def __init__(
        self,
        owner: CompiledDecode,
        cache: Any,
        prefilled: Any,
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
        # The whole cache's mask, fixed for the run: the prompts' padding masked, every later
        # position open (the causal mask hides those not yet written).
        self.mask = torch.ones((rows, length), dtype=mask.dtype, device=mask.device)
        self.mask[:, : self.width] = mask.index_select(0, self._pad)
        # The prompts' keys and values, written as an attention layer writes them.
        for index, layer in enumerate(prefilled.layers):
            keys, values = (
                layer.keys.index_select(0, self._pad),
                layer.values.index_select(0, self._pad),
            )
            cache.update(keys, values, index)
        self.written = self.width

    def _call(
        self,
        fn: Any,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        whole_mask: bool,
        **options: Any,
    ) -> Any:
        """`fn` (the model, or its compiled call) over `input_ids` written after what the cache
        holds. The compiled step sees the `whole_mask`, one shape for the run; an eager call the
        mask up to its last position."""
        end = self.written + input_ids.shape[1]
        out = fn(
            input_ids=input_ids,
            attention_mask=self.mask if whole_mask else self.mask[:, :end],
            position_ids=position_ids,
            use_cache=True,
            **{self.owner._cache_argument: self.cache},
            **options,
        )
        self.written = end
        return out

    def step(self, chosen: torch.Tensor, position: torch.Tensor) -> torch.Tensor | None:
        """One token per row through the compiled step; the next logits [B, V] in float32.
        None where the step failed (`CompiledDecode.failed`): the caller goes on eagerly."""
        call = self.owner._step_call()
        if self.owner.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        try:
            out = self._call(
                call,
                chosen.index_select(0, self._pad)[:, None],
                position.index_select(0, self._pad),
                whole_mask=True,
            )
        except Exception as error:
            self.owner.failed(error)
            return None
        self.owner.steps += 1
        # A graph's output is overwritten by its next replay: the logits are copied out.
        return out.logits[: self.real, -1].float().clone()

    def rebuild(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
        """Everything so far ([B, T]) into the emptied cache, eagerly (the weights changed); the
        last position's logits [B, V] in float32. None where that failed, as `step`."""
        self.cache.reset()
        self.written = 0
        try:
            out = self._call(
                self.owner.model,
                ids.index_select(0, self._pad),
                positions.index_select(0, self._pad),
                whole_mask=False,
                logits_to_keep=1,
            )
        except Exception as error:
            self.owner.failed(error)
            return None
        return out.logits[: self.real, -1].float()
