"""The served models by name, their load state and the policy version."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from app.common.inputs import InputPreparer
from app.config import Settings
from app.engine.base import Backend
from app.engine.loader import load_backend, resolve_source
from app.engine.types import GenerateItem, Generation
from app.errors import APIError

logger = logging.getLogger(__name__)
Status = Literal["loading", "ready", "failed", "stopped"]


@dataclass
class ServedModel:
    """A loaded backend with the input preparer for its tokenizer."""

    name: str
    backend: Backend
    preparer: InputPreparer

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return await self.backend.score(sequences)

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        return await self.backend.generate(items)


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
        served = ServedModel(backend.info.name, backend, preparer)
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
            await served.backend.aclose()
