"""Wire models of `POST /v1/logprobs`."""

from __future__ import annotations

from pydantic import Field

from app.common.protocol import ModelName, Sample, SplitInputFields, WireModel


class LogProbsRequest(SplitInputFields):
    """Sequences to score: messages, text or tokens, or a prompt/response split."""

    model: ModelName = "policy"


class LogProbsResponse(WireModel):
    policy_version: int
    model: ModelName
    pad_token_id: int = Field(description="The model's padding token (for padded layouts).")
    outputs: list[Sample]
