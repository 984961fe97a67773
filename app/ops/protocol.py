"""Wire models of the operational routes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from rlserve_client import types as containers

from app.common.protocol import WireModel


class HealthResponse(WireModel):
    status: Literal["ok"]
    model_status: Literal["loading", "ready", "failed", "stopped"]


class Lineage(WireModel):
    number: int = Field(default=0, description="0 from the start; one more at each restart.")
    since_version: int = Field(default=0, description="The first version served in it.")
    trainer_version: int | None = Field(
        default=None,
        description="The version its trainer named for that first update (null: lineage 0).",
    )


class ReadyResponse(WireModel):
    ready: bool
    policy_version: int
    paused: bool = Field(
        default=False, description="Serving is paused (POST /v1/resume, or an update ends it)."
    )
    pause_mode: Literal["wait", "abort", "keep"] | None = None
    lineage: Lineage = Field(
        default_factory=lambda: Lineage(),
        description="The policy's current lineage: a trainer that counts its versions again "
        "from below the served one (restarted from a checkpoint) opens the next.",
    )
    digests: dict[str, str] = Field(
        default_factory=dict,
        description="Each served model's weight digest (of its tensors' checksums), for the "
        "version it serves: a trainer compares it with rlserve_client.weight_delta."
        "weights_digest of its own weights. A model whose engine cannot show its weights "
        "(vLLM serving no local checkpoint, or values a collective transfer set) is absent.",
    )


class ModelCard(containers.ModelCard, WireModel):
    """OpenAI's model object (`id`, `object`, `created`, `owned_by`) with rlserve's fields."""


class ModelsResponse(WireModel):
    """OpenAI's model list (`object`, `data`); `models` holds the same cards."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[ModelCard]
    policy_version: int


class BatcherState(WireModel):
    queued_items: int
    queued_requests: int
    in_flight_calls: int
    num_calls: int
    num_items: int
    last_batch_sizes: list[int]


class ModelBatching(WireModel):
    score: BatcherState
    generate: BatcherState | None = None


class BatchingConfigOut(WireModel):
    min_batch_size: int
    max_batch_size: int
    batching_timeout_ms: float
    max_batch_tokens: int
    max_queue: int


class BatchingResponse(WireModel):
    enabled: bool
    config: BatchingConfigOut
    models: dict[str, ModelBatching]
