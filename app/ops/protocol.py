"""Wire models of the operational routes."""

from __future__ import annotations

from typing import Literal

from app.common.protocol import WireModel


class HealthResponse(WireModel):
    status: Literal["ok"]
    model_status: Literal["loading", "ready", "failed", "stopped"]


class ReadyResponse(WireModel):
    ready: bool
    policy_version: int


class ModelCard(WireModel):
    name: str
    source: str
    backend: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    builtin: bool


class ModelsResponse(WireModel):
    models: list[ModelCard]
    policy_version: int
