"""Find and load the served models: a configured path or hub id, or the built-in demo model."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path

from app.config import Settings
from app.engine.base import Backend
from app.engine.builtin_model import BUILDER_VERSION, DEMO_MARKER, build_model

logger = logging.getLogger(__name__)


def builtin_model_dir(settings: Settings) -> Path:
    """Build the demo model once into the cache directory (atomically) and return its path."""
    name = (
        f"builtin-v{BUILDER_VERSION}-qwen2-h{settings.builtin_hidden_size}"
        f"-l{settings.builtin_num_layers}-s{settings.builtin_seed}"
    )
    target = settings.cache_dir / name
    if (target / DEMO_MARKER).exists():
        return target
    settings.cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=settings.cache_dir))
    try:
        build_model(
            staging,
            hidden_size=settings.builtin_hidden_size,
            num_layers=settings.builtin_num_layers,
            seed=settings.builtin_seed,
        )
        try:
            os.rename(staging, target)
        except OSError:  # another process built it first
            if not (target / DEMO_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_source(settings: Settings) -> tuple[str, bool]:
    """(model source, whether it is the built-in demo model)."""
    if settings.model:
        return settings.model, False
    path = builtin_model_dir(settings)
    logger.warning(
        "serving the built-in demo model (%s): random weights, for trying the API only. "
        "Point at a real model with --model PATH_OR_HUB_ID or RLSERVE_MODEL.",
        path,
    )
    return str(path), True


def resolve_backend(settings: Settings) -> str:
    """'auto' picks vLLM when it is importable and a CUDA device is present."""
    if settings.backend != "auto":
        return settings.backend
    import torch

    from app.engine.vllm_backend import vllm_available

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


async def load_backend(
    settings: Settings, *, name: str, source: str, builtin: bool, num_engines: int = 1
) -> Backend:
    """Load one model with the configured backend, off the event loop where it blocks."""
    kind = resolve_backend(settings)
    from app.engine.transformers_backend import resolve_device

    cuda = resolve_device(settings.device).type == "cuda"
    dtype = await asyncio.to_thread(
        resolve_dtype,
        settings.dtype,
        source,
        cuda=cuda,
        trust_remote_code=settings.trust_remote_code,
    )
    logger.info("loading %s model from %s (backend=%s, dtype=%s)", name, source, kind, dtype)
    if kind == "vllm":
        from app.engine.vllm_backend import VLLMBackend

        options = {
            "gpu_memory_utilization": settings.gpu_memory_utilization / num_engines,
            "tensor_parallel_size": settings.tensor_parallel_size,
            "enforce_eager": settings.enforce_eager,
        }
        if settings.kv_cache_memory_bytes is not None:
            options["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
        if settings.enable_prefix_caching is not None:
            options["enable_prefix_caching"] = settings.enable_prefix_caching
        return await VLLMBackend.start(
            source,
            name=name,
            dtype=dtype,
            max_model_len=settings.max_model_len,
            trust_remote_code=settings.trust_remote_code,
            builtin=builtin,
            engine_options=options,
            processed_log_probs=settings.vllm_processed_log_probs,
            state_dir=settings.data_dir / "vllm-weights" / name,
        )
    from app.engine.transformers_backend import TransformersBackend

    return await asyncio.to_thread(
        TransformersBackend.load,
        source,
        name=name,
        dtype=dtype,
        device=settings.device,
        max_model_len=settings.max_model_len,
        trust_remote_code=settings.trust_remote_code,
        builtin=builtin,
    )
