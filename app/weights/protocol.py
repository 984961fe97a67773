"""Wire models of the weight routes."""

from __future__ import annotations

from pydantic import Field

from app.common.protocol import ModelName, WireModel


class WeightsVersion(WireModel):
    policy_version: int
    reference_version: int


class LoadWeightsRequest(WireModel):
    path: str = Field(
        min_length=1,
        description="A safetensors checkpoint directory (HF layout) or file the server can read.",
    )
    model: ModelName = Field(default="policy", description="reference only when targeted.")


class WeightsUpdated(WireModel):
    model: ModelName
    policy_version: int
    reference_version: int
    num_tensors: int
    num_bytes: int
    seconds: float = Field(description="Time the update held generation and scoring paused.")
