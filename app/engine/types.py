"""Plain data passed between the services and the backends (no pydantic, no HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingConfig:
    """Resolved generation parameters of one row (aliases already applied)."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    repetition_penalty: float = 1.0
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_prompt_log_probs: bool = False


@dataclass(frozen=True)
class GenerateItem:
    """One row to generate: a prompt, its parameters and the seed of its random stream."""

    prompt_ids: tuple[int, ...]
    config: SamplingConfig
    seed: int


@dataclass
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    processed_log_probs: list[float] | None
    finish_reason: FinishReason
    stop_reason: str | None = None
    prompt_log_probs: list[float] | None = None


@dataclass(frozen=True)
class ModelInfo:
    name: str
    source: str
    backend: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    builtin: bool = False
    extra: dict[str, str] = field(default_factory=dict)
