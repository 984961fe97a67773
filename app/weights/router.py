from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.common.protocol import ModelName
from app.deps import WeightsDep
from app.errors import WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, Body, access
from app.weights.protocol import LoadWeightsRequest, WeightsUpdated, WeightsVersion

router = APIRouter(tags=["weights"], responses=WEIGHTS_ERROR_RESPONSES)


@router.get("/v1/weights/version", response_model=WeightsVersion, summary="Current versions")
async def weights_version(weights: WeightsDep) -> WeightsVersion:
    return weights.version()


@router.post(
    "/v1/weights/load",
    response_model=WeightsUpdated,
    summary="Load from a path",
    openapi_extra=access(Access.ADMIN),
)
async def load_weights(request: LoadWeightsRequest, weights: WeightsDep) -> WeightsUpdated:
    """Load a safetensors checkpoint (HF layout, any subset of the parameters) from storage the
    server can read. Requests in flight finish first; new ones wait for the swap."""
    return await weights.load(request)


@router.put(
    "/v1/weights",
    response_model=WeightsUpdated,
    summary="Upload weights",
    openapi_extra={
        **access(Access.ADMIN, Body.STREAMED),
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        },
    },
)
async def upload_weights(
    request: Request,
    weights: WeightsDep,
    model: Annotated[ModelName, Query()] = "policy",
) -> WeightsUpdated:
    """Upload a safetensors file as the request body (streamed to disk, applied tensor by
    tensor). Partial updates are allowed."""
    return await weights.upload(request.stream(), model)
