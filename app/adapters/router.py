"""rlserve's LoRA adapter routes: load (or reload, as the next version), list and unload."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from app.adapters.protocol import NAME_PATTERN, AdapterInfo, AdapterList, LoadAdapterRequest
from app.deps import RegistryDep, WeightsDep
from app.errors import WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, Body, access

router = APIRouter(tags=["adapters"], responses=WEIGHTS_ERROR_RESPONSES)
AdapterPath = Annotated[str, Path(min_length=1, max_length=128, pattern=NAME_PATTERN)]


@router.post(
    "/v1/adapters",
    response_model=AdapterInfo,
    summary="Load a LoRA adapter",
    openapi_extra=access(Access.ADMIN),
)
async def load_adapter(request: LoadAdapterRequest, weights: WeightsDep) -> AdapterInfo:
    """Serve a LoRA adapter of the policy under `name`: every model route then takes `name`
    as its `model`, and its rows batch with the policy's and other adapters'. Loading a served
    name again serves the new tensors as its next version to new requests, while requests in
    flight finish on theirs: no pause."""
    return AdapterInfo.of(await weights.load_adapter(request.name, request.path, "path"))


@router.put(
    "/v1/adapters/{name:path}",
    response_model=AdapterInfo,
    summary="Push an adapter's new tensors",
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
async def push_adapter(name: AdapterPath, request: Request, weights: WeightsDep) -> AdapterInfo:
    """A trainer's step: the adapter's tensors as one safetensors file (PEFT's names, as
    `get_peft_model_state_dict` gives them; the layers and shapes it was loaded with), served as
    its next version to new requests while requests in flight finish on theirs: no pause. The
    config stays the one it was loaded with."""
    return AdapterInfo.of(await weights.push_adapter(name, request.stream()))


@router.get("/v1/adapters", response_model=AdapterList, summary="Served adapters")
async def list_adapters(registry: RegistryDep) -> AdapterList:
    adapters = sorted(registry.adapters.values(), key=lambda a: a.name)
    return AdapterList(adapters=[AdapterInfo.of(a) for a in adapters])


@router.delete(
    "/v1/adapters/{name:path}",
    response_model=AdapterInfo,
    summary="Unload a LoRA adapter",
    openapi_extra=access(Access.ADMIN),
)
async def unload_adapter(name: AdapterPath, weights: WeightsDep) -> AdapterInfo:
    """New requests can no longer name it; requests in flight finish with it."""
    return AdapterInfo.of(await weights.unload_adapter(name, "name"))
