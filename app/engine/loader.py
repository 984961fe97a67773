"""Find and load the served models: a folder, a hub id, or a built-in model (`builtin:NAME`:
SmolLM2-135M-Instruct from its PyPI wheel, the default, or the tiny random one for tests)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from app.config_groups import ModelSettings, VllmSettings
from app.engine import smollm2
from app.engine.base import Backend
from app.engine.builtin_model import BUILDER_VERSION, DEMO_MARKER, build_model

logger = logging.getLogger(__name__)


BUILTIN_PREFIX = "builtin:"
TINY = "tiny"
TINY_MOE = "tiny-moe"
TINY_REWARD = "tiny-reward"


def builtin_model_dir(models: ModelSettings) -> Path:
    """The tiny random-weights model (`builtin:tiny`), built once into the cache directory."""
    return _builtin_dir(models, "qwen2", models.builtin_num_layers)


def builtin_moe_dir(models: ModelSettings) -> Path:
    """The tiny random-weights mixture-of-experts model (`builtin:tiny-moe`): Qwen3-MoE with
    three layers (the middle one dense), built once into the cache directory."""
    return _builtin_dir(models, "qwen3moe", 3, moe=True)


def builtin_reward_dir(models: ModelSettings) -> Path:
    """The tiny random-weights reward model (`builtin:tiny-reward`): Qwen2 with a one-label
    sequence-classification head, the built-in tokenizer, built once into the cache
    directory."""
    return _builtin_dir(models, "qwen2reward", models.builtin_num_layers, reward=True)


def _builtin_dir(
    models: ModelSettings, arch: str, num_layers: int, *, moe: bool = False, reward: bool = False
) -> Path:
    size, seed = models.builtin_hidden_size, models.builtin_seed
    name = f"builtin-v{BUILDER_VERSION}-{arch}-h{size}-l{num_layers}-s{seed}"
    return _cached(
        models.cache_dir,
        name,
        DEMO_MARKER,
        lambda staging: build_model(
            staging, hidden_size=size, num_layers=num_layers, seed=seed, moe=moe, reward=reward
        ),
    )


def smollm2_dir(models: ModelSettings) -> Path:
    """SmolLM2-135M-Instruct (`builtin:smollm2-135m-instruct`, the default), converted once
    from its wheel into the cache directory."""
    name = f"{smollm2.NAME}-v{smollm2.CONVERTER_VERSION}"
    return _cached(models.cache_dir, name, smollm2.MARKER, smollm2.convert)


def _cached(cache_dir: Path, name: str, marker: str, build: Callable[[Path], Path]) -> Path:
    """`build` into a staging folder renamed into place (atomic: concurrent starts agree)."""
    target = cache_dir / name
    if (target / marker).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info(
        "preparing %s once into %s (about half a minute on a laptop's CPU; later starts load "
        "it from there)",
        name,
        target,
    )
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        build(staging)
        try:
            os.rename(staging, target)
        except OSError:  # another process built it first
            if not (target / marker).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


BUILTIN_MODELS: dict[str, Callable[[ModelSettings], Path]] = {
    smollm2.NAME: smollm2_dir,
    TINY: builtin_model_dir,
    TINY_MOE: builtin_moe_dir,
    TINY_REWARD: builtin_reward_dir,
}


def resolve_model(models: ModelSettings, model: str) -> tuple[str, bool]:
    """(model source, whether it is built in) for a `builtin:NAME`, a folder or a hub id."""
    if not model.startswith(BUILTIN_PREFIX):
        return model, False
    name = model.removeprefix(BUILTIN_PREFIX)
    build = BUILTIN_MODELS.get(name)
    if build is None:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise ValueError(f"unknown built-in model {model!r} (have {known})")
    path = build(models)
    if name in (TINY, TINY_REWARD):
        logger.warning(
            "serving the tiny built-in model (%s): random weights, for tests only. "
            "Leave RLSERVE_MODELS__MODEL unset for the default real model.",
            path,
        )
    return str(path), True


def resolve_source(models: ModelSettings) -> tuple[str, bool]:
    """(policy source, whether it is built in)."""
    return resolve_model(models, models.model)


def resolve_backend(models: ModelSettings) -> str:
    """'auto' picks vLLM when it is importable and a CUDA device is present."""
    if models.backend != "auto":
        return models.backend
    import torch

    from app.engine.vllm.backend import vllm_available

    return "vllm" if vllm_available() and torch.cuda.is_available() else "transformers"


_CHECKPOINT_DTYPES = {"float32", "bfloat16", "float16"}


def resolve_dtype(setting: str, source: str, *, cuda: bool, trust_remote_code: bool) -> str:
    """`auto` resolved once, from the checkpoint, the same for every backend: the checkpoint's
    dtype (float32 when it names none), except float16 on CPU, which runs as float32 (slow and
    inexact there). So both backends serve a float32 checkpoint in float32 by default."""
    if setting != "auto":
        return setting
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(stored).removeprefix("torch.") if stored is not None else "float32"
    checkpoint = name if name in _CHECKPOINT_DTYPES else "float32"
    resolved = "float32" if checkpoint == "float16" and not cuda else checkpoint
    logger.info(
        "dtype auto: %s (the checkpoint stores %s%s)",
        resolved,
        name,
        "; float16 runs as float32 on CPU" if resolved != checkpoint else "",
    )
    return resolved


async def checkpoint_dtype(models: ModelSettings, source: str) -> str:
    """The dtype `source` is served in (`models.dtype`; `auto` read from its checkpoint off
    the event loop, `resolve_dtype`)."""
    from app.engine.transformers.backend import resolve_device

    return await asyncio.to_thread(
        resolve_dtype,
        models.dtype,
        source,
        cuda=resolve_device(models.device).type == "cuda",
        trust_remote_code=models.trust_remote_code,
    )


async def load_backend(
    models: ModelSettings,
    vllm: VllmSettings,
    *,
    name: str,
    source: str,
    builtin: bool,
    state_dir: Path,
    num_engines: int = 1,
) -> Backend:
    """Load one model with the configured backend, off the event loop where it blocks
    (`state_dir`: where a vLLM engine keeps its weight-update state)."""
    kind = resolve_backend(models)
    dtype = await checkpoint_dtype(models, source)
    logger.info("loading %s model from %s (backend=%s, dtype=%s)", name, source, kind, dtype)
    if kind == "vllm":
        from app.engine.vllm.backend import VLLMBackend

        options = {
            "gpu_memory_utilization": vllm.gpu_memory_utilization / num_engines,
            "tensor_parallel_size": vllm.tensor_parallel_size,
            "enforce_eager": vllm.enforce_eager,
        }
        if vllm.kv_cache_memory_bytes is not None:
            options["kv_cache_memory_bytes"] = vllm.kv_cache_memory_bytes
        if vllm.enable_prefix_caching is not None:
            options["enable_prefix_caching"] = vllm.enable_prefix_caching
        if vllm.max_loras and name == "policy":  # (adapters are the policy's alone)
            options |= {
                "enable_lora": True,
                "max_loras": vllm.max_loras,
                "max_lora_rank": vllm.max_lora_rank,
                # adapters (and versions) kept loaded beside the batch's, least recent out
                "max_cpu_loras": max(4 * vllm.max_loras, 32),
            }
        return await VLLMBackend.start(
            source,
            name=name,
            dtype=dtype,
            max_model_len=models.max_model_len,
            trust_remote_code=models.trust_remote_code,
            builtin=builtin,
            engine_options=options,
            processed_log_probs=vllm.processed_log_probs,
            state_dir=state_dir,
        )
    from app.engine.transformers.backend import TransformersBackend

    return await asyncio.to_thread(
        TransformersBackend.load,
        source,
        name=name,
        dtype=dtype,
        device=models.device,
        max_model_len=models.max_model_len,
        trust_remote_code=models.trust_remote_code,
        builtin=builtin,
        compile_decode=models.compile_decode and name != "reference",  # (which scores)
        prefix_cache_bytes=0 if name == "reference" else models.prefix_cache_bytes,
    )
