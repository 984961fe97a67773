"""rlserve's LoRA adapter routes: load (or reload, as the next version), list and unload."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.adapters.protocol import AdapterInfo, AdapterList, AdapterName, LoadAdapterRequest
from app.deps import RegistryDep, WeightsDep
from app.errors import WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, access

router = APIRouter(tags=["adapters"], responses=WEIGHTS_ERROR_RESPONSES)


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
async def unload_adapter(
    name: Annotated[str, Path(min_length=1, max_length=128)], weights: WeightsDep
) -> AdapterInfo:
    """New requests can no longer name it; requests in flight finish with it."""
    return AdapterInfo.of(await weights.unload_adapter(name, "name"))


__all__ = ["AdapterName", "router"]
