"""The served models by name, their load state and the policy version."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Sequence
from typing import Literal, TypeVar

from app.batching import BackendCallError, Batcher, BatchingConfig
from app.common.inputs import InputPreparer
from app.config import Settings
from app.engine.base import Backend
from app.engine.loader import load_backend, resolve_source
from app.engine.types import GenerateItem, Generation
from app.errors import APIError

logger = logging.getLogger(__name__)
Status = Literal["loading", "ready", "failed", "stopped"]
R = TypeVar("R")


class ServedModel:
    """A loaded backend, the input preparer for its tokenizer, and its request batchers."""

    def __init__(
        self, backend: Backend, preparer: InputPreparer, batching: BatchingConfig | None
    ) -> None:
        self.name = backend.info.name
        self.backend = backend
        self.preparer = preparer
        self.batching = batching
        self.scoring: Batcher[Sequence[int], list[float]] | None = None
        self.generation: Batcher[GenerateItem, Generation] | None = None
        if batching is not None:
            self.scoring = Batcher(f"{self.name}/score", self._score_batch, len, batching)
            self.generation = Batcher(
                f"{self.name}/generate", self._generate_batch, _generation_length, batching
            )

    async def _score_batch(self, sequences: list[Sequence[int]]) -> list[list[float]]:
        return await self.backend.score(sequences)

    async def _generate_batch(self, items: list[GenerateItem]) -> list[Generation]:
        return await self.backend.generate(items)

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        if self.scoring is None:
            return await _direct(self.backend.score(sequences))
        return await self.scoring.submit(sequences)

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        if self.generation is None:
            return await _direct(self.backend.generate(items))
        return await self.generation.submit(items)

    async def aclose(self) -> None:
        for batcher in (self.scoring, self.generation):
            if batcher is not None:
                await batcher.aclose()
        await self.backend.aclose()


def _generation_length(item: GenerateItem) -> int:
    return len(item.prompt_ids) + item.config.max_new_tokens


async def _direct(call: Awaitable[R]) -> R:
    """Batching off: one backend call per request, errors reported like batched ones."""
    try:
        return await call
    except Exception as exc:
        logger.exception("backend call failed")
        raise BackendCallError(f"{type(exc).__name__}: {exc}") from exc


class ModelRegistry:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, ServedModel] = {}
        self.status: Status = "loading"
        self.error: str | None = None
        self.policy_version = 0

    async def load(self) -> None:
        """Load the policy off the event loop; failures are kept for /ready to report."""
        try:
            source, builtin = await asyncio.to_thread(resolve_source, self.settings)
            backend = await asyncio.to_thread(
                load_backend, self.settings, name="policy", source=source, builtin=builtin
            )
            self.add(backend)
            self.status = "ready"
            logger.info("ready: %s", backend.info)
        except Exception as exc:
            logger.exception("model loading failed")
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"

    def add(self, backend: Backend) -> ServedModel:
        preparer = InputPreparer(
            backend.tokenizer,
            vocab_size=backend.info.vocab_size,
            max_model_len=backend.info.max_model_len,
        )
        batching = self.settings.batching_config() if self.settings.batching else None
        served = ServedModel(backend, preparer, batching)
        self.models[served.name] = served
        return served

    def get(self, name: str) -> ServedModel:
        if self.status != "ready":
            detail = f": {self.error}" if self.error else ""
            raise APIError(503, f"model is {self.status}{detail}", type="unavailable_error")
        if name not in self.models:
            raise APIError(
                422, f"model: '{name}' is not served (have {sorted(self.models)})", param="model"
            )
        return self.models[name]

    async def aclose(self) -> None:
        self.status = "stopped"
        for served in self.models.values():
            await served.aclose()
