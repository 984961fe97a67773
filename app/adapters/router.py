"""rlserve's LoRA adapter routes: load (or reload, as the next version), push, pause, resume,
list and unload.

Each adapter belongs to the key that first served it: with API keys set, only that key or an
admin key may push to it, pause it, resume it or unload it. Loading from a server path needs
an admin key (it reads the server's disk); a first upload serves a new adapter with any key."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request
from starlette.convertors import Convertor, register_url_convertor

from app.adapters.protocol import (
    AdapterInfo,
    AdapterList,
    LoadAdapterRequest,
    PauseAdapterRequest,
)
from app.common.failures import worded
from app.common.protocol import ADAPTER_NAME_PATTERN
from app.common.roles import Role
from app.deps import CallerDep, RegistryDep, WeightsDep
from app.errors import ADAPTER_ERROR_RESPONSES
from app.ops.access import Access, Body, access
from app.ops.limits import declared_size
from app.updates.types import Streamed

router = APIRouter(tags=["adapters"], responses=ADAPTER_ERROR_RESPONSES)
LOADED = {Role.ADAPTER: "name", Role.ADAPTER_SOURCE: "path", Role.ADAPTER_CONFIG: "path"}
"""The fields an adapter's refusals name (`app.updates.adapters`' roles), per route."""
PUSHED = {Role.ADAPTER: "name", Role.ADAPTER_SOURCE: "body", Role.ADAPTER_CONFIG: "name"}
NAMED = {Role.ADAPTER: "name"}
AdapterPath = Annotated[str, Path(min_length=1, max_length=128, pattern=ADAPTER_NAME_PATTERN)]


class _AdapterNameConvertor(Convertor[str]):
    """An adapter's name in a path: it may hold '/', but a path ending in /pause or /resume
    belongs to those routes, so a PUT or DELETE there is a 405 naming POST, not a push to or
    an unload of an adapter named 'NAME/pause'."""

    regex = r"(?!.*/(?:pause|resume)$).+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("adapter", _AdapterNameConvertor())


@router.post(
    "/v1/adapters",
    response_model=AdapterInfo,
    summary="Load a LoRA adapter",
    openapi_extra=access(Access.ADMIN),
)
async def load_adapter(
    request: LoadAdapterRequest, weights: WeightsDep, registry: RegistryDep, caller: CallerDep
) -> AdapterInfo:
    """Serve a LoRA adapter of the policy under `name`: every model route then takes `name`
    as its `model`, and its rows batch with the policy's and other adapters'. Loading a served
    name again serves the new tensors as its next version to new requests, while requests in
    flight finish on theirs: no pause."""
    with worded(LOADED):
        adapter = await weights.load_adapter(request.name, request.path, caller=caller)
    return AdapterInfo.of(adapter, registry.adapter_state(adapter.name))


@router.put(
    "/v1/adapters/{name:adapter}",
    response_model=AdapterInfo,
    summary="Push an adapter's tensors",
    openapi_extra={
        **access(Access.OWNER, Body.STREAMED),
        "requestBody": {
            "required": True,
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        },
    },
)
async def push_adapter(
    name: AdapterPath,
    request: Request,
    weights: WeightsDep,
    registry: RegistryDep,
    caller: CallerDep,
) -> AdapterInfo:
    """A trainer's step: the adapter's tensors as one safetensors file (PEFT's names, as
    `get_peft_model_state_dict` gives them), served as its next version to new requests while
    requests in flight finish on theirs: no pause. The file's metadata may carry the adapter's
    config under `adapter_config` (the text of PEFT's adapter_config.json): a name not served
    yet needs it, and is then served at version 0, owned by the pushing key. A served adapter
    keeps its layers and shapes; without that metadata, its config too."""
    with worded(PUSHED):
        body = Streamed(request.stream(), declared_size(request.headers))
        adapter = await weights.push_adapter(name, body, caller=caller)
    return AdapterInfo.of(adapter, registry.adapter_state(adapter.name))


@router.post(
    "/v1/adapters/{name:path}/pause",
    response_model=AdapterInfo,
    summary="Pause one adapter",
    openapi_extra=access(Access.OWNER),
)
async def pause_adapter(
    name: AdapterPath, request: PauseAdapterRequest, weights: WeightsDep, caller: CallerDep
) -> AdapterInfo:
    """Hold back new requests naming the adapter until its resume; returns once its requests
    inside met `mode`. The policy and other adapters serve on, and a global pause
    (`/v1/pause`) is separate from this one."""
    with worded(NAMED):
        return AdapterInfo.of(*await weights.pause_adapter(name, request.mode, caller=caller))


@router.post(
    "/v1/adapters/{name:path}/resume",
    response_model=AdapterInfo,
    summary="Resume one adapter",
    openapi_extra=access(Access.OWNER),
)
async def resume_adapter(name: AdapterPath, weights: WeightsDep, caller: CallerDep) -> AdapterInfo:
    with worded(NAMED):
        return AdapterInfo.of(*await weights.resume_adapter(name, caller=caller))


@router.get("/v1/adapters", response_model=AdapterList, summary="Served adapters")
async def list_adapters(registry: RegistryDep) -> AdapterList:
    adapters = sorted(registry.adapters.values(), key=lambda a: a.name)
    return AdapterList(
        adapters=[AdapterInfo.of(a, registry.adapter_state(a.name)) for a in adapters]
    )


@router.delete(
    "/v1/adapters/{name:adapter}",
    response_model=AdapterInfo,
    summary="Unload a LoRA adapter",
    openapi_extra=access(Access.OWNER),
)
async def unload_adapter(name: AdapterPath, weights: WeightsDep, caller: CallerDep) -> AdapterInfo:
    """New requests can no longer name it (those waiting on its pause are refused); requests
    in flight finish with it."""
    with worded(NAMED):
        return AdapterInfo.of(await weights.unload_adapter(name, caller=caller))
