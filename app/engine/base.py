"""The backend contract: one small async interface that every model engine implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.batching import BatchingConfig
from app.engine.types import GenerateItem, Generation, ModelInfo
from app.weights.checkpoint import Layout


class Backend(ABC):
    """A loaded model. Methods take whole batches; batching policy lives outside."""

    info: ModelInfo
    tokenizer: Any

    @abstractmethod
    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        """One Generation per item, in order."""

    @abstractmethod
    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per sequence, log p(x_t | x_<t) for every position; position 0 is 0.0."""

    async def check(self) -> None:
        """Raise if the engine cannot serve: by default, score a two-token sequence (a real
        forward through the model, as a readiness probe should make)."""
        await self.score([[0, 0]])

    def weight_layout(self) -> Layout | None:
        """Names, dtypes and shapes an update may carry; None when unknown (not checked)."""
        return None

    async def update_weights(self, files: list[Path]) -> None:
        """Copy the tensors of checked safetensors files into the live model."""
        raise NotImplementedError(f"{type(self).__name__} cannot update weights")

    def batching(self, base: BatchingConfig) -> tuple[BatchingConfig, BatchingConfig]:
        """(scoring, generation) batching for this backend. By default both group requests
        into calls; an engine that batches continuously overrides this."""
        return base, base

    async def aclose(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the model and any worker processes or threads."""
