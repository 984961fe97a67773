"""Backend on a HuggingFace transformers model. Model calls run on one worker thread, so they
never block the event loop and never run concurrently on the same weights."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rlserve_client.moe import Routing

from app.engine.base import Backend, Capabilities, ScoreItem
from app.engine.transformers import decode as hf_decode
from app.engine.transformers.compiled import CompiledDecode
from app.engine.transformers.freeze import ModelThreadControl
from app.engine.transformers.lora import LoraHooks
from app.engine.transformers.memory import release_after
from app.engine.transformers.prefix_cache import PrefixCache
from app.engine.types import (
    GenerateItem,
    Generation,
    ModelInfo,
    PrefixCacheStats,
    SamplingConfig,
    Scores,
)
from app.weights.checkpoint import Layout, copy_into, layout_of_state
from app.weights.delta import Change, state_checksums, write_changes
from app.weights.expert_names import checkpoint_views
from app.weights.lora import AdapterBuild, LoraAdapter
from app.weights.lora_layout import adapter_from
from app.weights.staging import adopt
from app.weights.transfer_engine import InProcessTransfer, WeightTransfer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class TransformersBackend(Backend):
    capabilities = Capabilities(
        weight_transfer=True,
        processed_log_probs=True,
        batch_invariant=True,
        adapters=True,
        weight_deltas=True,
    )

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        info: ModelInfo,
        *,
        compile_decode: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.pad_id = _pad_id(tokenizer, model)
        self.eos_ids = _eos_ids(tokenizer, model)
        self.control = ModelThreadControl()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"model-{info.name}")
        self._transfer: InProcessTransfer | None = None
        self.lora: LoraHooks | None = None  # hooks on the adapted layers, once an adapter loads
        self.routing: Routing | None = Routing.of(model)
        """Hooks on a mixture-of-experts model's routers: routed experts recorded and replayed."""
        if self.routing is not None:
            self.capabilities = replace(self.capabilities, routed_experts=True)
        self.prefix = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
        """Keys and values of recent sequences (`models.prefix_cache_bytes`)."""
        self.compiled: CompiledDecode | None = None
        """Decoding steps compiled over a static cache (`models.compile_decode`)."""
        if compile_decode and self.routing is not None:
            logger.warning("%s: a mixture-of-experts model decodes eagerly", info.name)
        elif compile_decode:
            self.compiled = CompiledDecode(model)
            self._worker.submit(self._warm_up).result()

    def _warm_up(self) -> None:
        """The decode step compiled before the model serves, so that no request waits for
        it: a row alone and four (torch.compile specializes a batch of one, and might a
        batch of two to a model dimension of that size)."""
        assert self.compiled is not None
        started = time.perf_counter()
        config = SamplingConfig(max_new_tokens=3, ignore_eos=True)
        for rows in (1, 4):
            items = [GenerateItem((self.pad_id,) * 4, config, seed=row) for row in range(rows)]
            try:
                self._generate(items)
            except Exception as error:  # the model serves, eagerly
                self.compiled.failed(error)
        state = "compiled" if self.compiled.usable() else "not compiled: decoding eagerly"
        logger.info(
            "%s: decode step %s in %.1f s", self.info.name, state, time.perf_counter() - started
        )

    @classmethod
    def load(
        cls,
        source: str,
        *,
        name: str,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        builtin: bool = False,
        compile_decode: bool = False,
        prefix_cache_bytes: int = 0,
    ) -> TransformersBackend:
        from transformers import AutoModelForCausalLM

        model, tokenizer = load_pretrained(
            AutoModelForCausalLM,
            source,
            dtype=dtype,
            device=device,
            trust_remote_code=trust_remote_code,
        )
        info = model_info(
            model,
            name=name,
            source=source,
            device=device,
            max_model_len=max_model_len,
            builtin=builtin,
        )
        return cls(
            model,
            tokenizer,
            info,
            compile_decode=compile_decode,
            prefix_cache_bytes=prefix_cache_bytes,
        )

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """`fn` on the model thread; it waits there while the model is frozen."""

        def call() -> Any:
            with self.control.running():
                return fn(*args, **kwargs)

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, call)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        size = len(sequences) * max((len(s) for s in sequences), default=0)
        result: list[list[float]] = await self._run(
            _released, size, hf_decode.score, self.model, sequences, self.pad_id
        )
        return result

    async def score_detailed(self, items: Sequence[ScoreItem]) -> list[Scores]:
        size = len(items) * max((len(seq) for seq, _ in items), default=0)
        result: list[Scores] = await self._run(
            _released,
            size,
            hf_decode.score_detailed,
            self.model,
            items,
            self.pad_id,
            self.lora,
            self.routing,
        )
        return result

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        longest = max((len(it.prompt_ids) + it.config.max_new_tokens for it in items), default=0)
        result: list[Generation] = await self._run(
            _released, len(items) * longest, self._generate, items
        )
        return result

    def _generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        """`items` decoded together (blocking: on the model thread)."""
        return hf_decode.generate(
            self.model,
            items,
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            decode=self.tokenizer.decode,
            control=self.control,
            lora=self.lora,
            routing=self.routing,
            compiled=self.compiled,
            prefix=self.prefix,
        )

    def prefix_cache(self) -> PrefixCacheStats | None:
        return None if self.prefix is None else self.prefix.stats()

    async def build_adapter(self, build: AdapterBuild) -> LoraAdapter:
        adapter = await asyncio.to_thread(adapter_from, build, self.model)
        # Hooks are added on the model thread, between model calls, never during one.
        await self._run(self._install, adapter)
        return adapter

    def _install(self, adapter: LoraAdapter) -> None:
        if self.lora is None:
            self.lora = LoraHooks(self.model)
        self.lora.install(adapter)

    def forget_adapter(self, adapter: LoraAdapter) -> None:
        if self.lora is not None:
            self.lora.forget(adapter)

    def weight_layout(self) -> Layout:
        return layout_of_state(checkpoint_views(self.model))

    # Weight changes run while the gate holds the model frozen (no call between two
    # checkpoints), so they go on a thread of their own, not behind the parked model thread.

    async def update_weights(self, files: list[Path]) -> None:
        await asyncio.to_thread(copy_into, checkpoint_views(self.model), files)

    def served_tensor(self, name: str) -> torch.Tensor | None:
        return checkpoint_views(self.model).get(name)

    async def write_tensors(self, changes: dict[str, Change]) -> None:
        await asyncio.to_thread(write_changes, checkpoint_views(self.model), changes)

    def weight_checksums(
        self, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
    ) -> dict[str, str] | None:
        return state_checksums(self.model.state_dict(), names, known)

    def transfer(self) -> WeightTransfer:
        if self._transfer is None:
            in_place = self.compiled is not None and self.compiled.graphs
            self._transfer = InProcessTransfer(
                self.model.device, partial(adopt, self.model, in_place=in_place)
            )
        return self._transfer

    async def freeze(self) -> None:
        await asyncio.to_thread(self.control.freeze)

    async def thaw(self) -> None:
        self.control.aborting.clear()
        self.control.thaw()

    async def abort_generations(self) -> None:
        self.control.aborting.set()

    def stepped_at(self) -> float:
        return self.control.stepped_at

    async def set_version(self, version: int, *, keep_cache: bool = False) -> None:
        self.control.version = version
        if self.prefix is not None:
            self.prefix.weights_changed(version, keep=keep_cache)

    async def aclose(self) -> None:
        if self._transfer is not None:
            await self._transfer.close()
        self.control.thaw()
        self._worker.shutdown(wait=True, cancel_futures=True)


def load_pretrained(
    model_class: Any, source: str, *, dtype: str, device: str, trust_remote_code: bool
) -> tuple[Any, Any]:
    """A transformers model of `model_class` and its tokenizer from `source`, on `device`, in
    evaluation mode without gradients, owning its weights (`_own_memory`)."""
    from transformers import AutoTokenizer

    target = resolve_device(device)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    model = model_class.from_pretrained(
        source,
        dtype=_DTYPES[dtype] if dtype != "auto" else "auto",
        trust_remote_code=trust_remote_code,
    )
    model = model.to(device=target).eval()
    model.requires_grad_(False)
    if target.type == "cpu":
        _own_memory(model)
    return model, tokenizer


def model_info(
    model: Any, *, name: str, source: str, device: str, max_model_len: int | None, builtin: bool
) -> ModelInfo:
    """A loaded transformers model as `/v1/models` describes it; its length is at most its
    position embeddings' (2048 when its config names none)."""
    native_len = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return ModelInfo(
        name=name,
        source=str(source),
        backend="transformers",
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(resolve_device(device)),
        max_model_len=min(max_model_len or native_len, native_len),
        vocab_size=int(model.config.vocab_size),
        builtin=builtin,
    )


def _own_memory(model: torch.nn.Module) -> None:
    """Copy the weights out of the checkpoint files. On the CPU, transformers leaves them as
    views of the safetensors files it mapped: a checkpoint later written over those files (a
    trainer saving into the folder the server loaded) would change the served weights under
    their version, with no update. (Tied weights stay tied: one parameter object.)"""
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()


def _pad_id(tokenizer: Any, model: Any) -> int:
    for candidate in (tokenizer.pad_token_id, model.config.pad_token_id, tokenizer.eos_token_id):
        if isinstance(candidate, int):
            return candidate
    return 0


def _eos_ids(tokenizer: Any, model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(x) for x in source)
    return frozenset(ids)


def _released(num_tokens: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """`fn`'s result; after a large call, its freed memory goes back to the OS."""
    try:
        return fn(*args, **kwargs)
    finally:
        release_after(num_tokens)
