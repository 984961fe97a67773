"""The routes AReaL's own vLLM server adds (`areal/engine/vllm_ext/areal_vllm_server.py`,
AReaL 1.0.4), which its remote vLLM engine drives: pause and continue, a weight update from a
path, and its distributed update (join the group, name the tensors, receive them). They are
SGLang's flow under other names, so they share its update session (`SGLangWeights`): buckets
received while paused are committed, all at once, at the continue."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Request
from pydantic import Field

from app.common.failures import invalid
from app.common.protocol import WireModel
from app.deps import WeightsDep
from app.dialects.sglang.protocol import UpdateWeightsFromDistributed
from app.dialects.sglang.serving import SGLangWeights
from app.errors import TRANSFER_ERROR_RESPONSES, WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, access
from app.weights.protocol import LoadWeightsRequest, TransferInit

router = APIRouter(tags=["AReaL's vLLM routes"], responses=TRANSFER_ERROR_RESPONSES)
ADMIN = access(Access.ADMIN)


class Outcome(WireModel):
    success: bool = True
    message: str


class UpdateWeights(WireModel):
    model_path: str = Field(min_length=1)
    load_format: str | None = Field(default="auto", description="Only auto or safetensors.")
    abort_all_requests: bool = Field(default=False, description="Accepted: the load pauses.")


class UpdateGroup(WireModel):
    master_address: str = Field(min_length=1, max_length=253)
    master_port: Annotated[int, Field(ge=1, le=65535)]
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2, le=4096)
    backend: Literal["nccl", "gloo"] = "nccl"
    group_name: str = Field(default="weight_update_group", min_length=1, max_length=256)


class WeightMeta(WireModel):
    names: list[str] = Field(min_length=1, max_length=1 << 20)
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = Field(default="weight_update_group", max_length=256)


def _session(request: Request) -> SGLangWeights:
    session: SGLangWeights = request.app.state.sglang_weights
    return session


@router.post(
    "/areal_pause_generation",
    response_model=Outcome,
    summary="Pause (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def pause(weights: WeightsDep) -> Outcome:
    """End in-flight generations (finish_reason abort: AReaL sends them again) and hold new
    ones until the continue."""
    await weights.pause("abort")
    return Outcome(message="Generation paused and all requests aborted")


@router.post(
    "/areal_continue_generation",
    response_model=Outcome,
    summary="Continue (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def resume(request: Request) -> Outcome:
    """Commit the tensors received while paused (all at once, or none), then resume."""
    await _session(request).continue_generation()
    return Outcome(message="Generation continued")


@router.post(
    "/areal_update_weights",
    response_model=Outcome,
    responses=WEIGHTS_ERROR_RESPONSES,
    summary="Load from a path (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def update_weights(body: UpdateWeights, weights: WeightsDep) -> Outcome:
    """POST /v1/weights/load: a safetensors checkpoint the server can read, whole or not at
    all."""
    if body.load_format not in (None, "auto", "safetensors"):
        raise invalid("load_format", "only safetensors checkpoints are loaded")
    updated = await weights.load(LoadWeightsRequest(path=body.model_path))
    return Outcome(message=f"Weights updated to version {updated.policy_version}")


@router.post(
    "/areal_init_weights_update_group",
    response_model=Outcome,
    summary="Join the trainer (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def init_group(body: UpdateGroup, weights: WeightsDep) -> Outcome:
    """Join as AReaL's vLLM workers do: torch's tcp:// rendezvous, the store under
    `group_name`, at ranks rank_offset… (returns once every rank is in)."""
    await weights.transfer_init(
        TransferInit(
            master_address=body.master_address,
            master_port=body.master_port,
            world_size=body.world_size,
            rank_offset=body.rank_offset,
            transport=body.backend,
            streams=1,
            rendezvous="torch",
            group_name=body.group_name,
        )
    )
    return Outcome(message="Weight update group initialized")


@router.post(
    "/areal_set_update_weight_meta",
    response_model=Outcome,
    summary="Name the tensors (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def set_meta(body: WeightMeta, request: Request) -> Outcome:
    _session(request).announce(
        UpdateWeightsFromDistributed(
            names=body.names, dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name
        )
    )
    return Outcome(message="Weight meta set")


@router.post(
    "/areal_update_weights_xccl",
    response_model=Outcome,
    summary="Receive the tensors (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def update_xccl(request: Request) -> Outcome:
    """Receive the tensors the last meta named, one broadcast each: committed at the continue
    while paused (as AReaL's loop runs it), else at once."""
    updated = await _session(request).update_announced()
    if updated is None:
        return Outcome(message="Received; applied with the rest of the update at the continue")
    return Outcome(message=f"Weights updated to version {updated.policy_version}")
