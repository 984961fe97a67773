import dataclasses
from typing import Annotated

from fastapi import APIRouter, Query, Request

from app.deps import CallerDep, RegistryDep, WeightsDep
from app.engine.gate import GateState
from app.engine.types import MAX_VERSION
from app.errors import (
    ERROR_RESPONSES,
    PAUSE_ERROR_RESPONSES,
    TRANSFER_ERROR_RESPONSES,
    WEIGHTS_ERROR_RESPONSES,
    ErrorResponse,
)
from app.ops.access import Access, Body, access
from app.ops.limits import declared_size
from app.updates.protocol import (
    LoadWeightsRequest,
    PauseMode,
    PauseRequest,
    RestoreWeightsRequest,
    ServedSnapshots,
    ServingState,
    SnapshotRequest,
    TransferFinish,
    TransferInit,
    TransferStart,
    TransferState,
    TransferTarget,
    TransferUpdate,
    UpdatedModel,
    WeightsUpdated,
    WeightsVersion,
)
from app.updates.types import AdapterPush, Publish, Streamed

router = APIRouter(tags=["weights"], responses=WEIGHTS_ERROR_RESPONSES)
transfer_router = APIRouter(
    prefix="/v1/weights/transfer", tags=["weight transfer"], responses=TRANSFER_ERROR_RESPONSES
)
serving_router = APIRouter(tags=["serving"], responses=ERROR_RESPONSES)
ADMIN = access(Access.ADMIN)


@router.get("/v1/weights/version", response_model=WeightsVersion, summary="Current versions")
async def weights_version(weights: WeightsDep) -> WeightsVersion:
    return WeightsVersion.of(weights.version())


@router.post(
    "/v1/weights/load",
    response_model=WeightsUpdated,
    summary="Load from a path",
    openapi_extra=ADMIN,
)
async def load_weights(request: LoadWeightsRequest, weights: WeightsDep) -> WeightsUpdated:
    """Load a safetensors checkpoint (HF layout, any subset of the parameters) from storage the
    server can read. Serving pauses for the swap only (`pause`, 'keep' by default)."""
    applied = await weights.load(request.path, request.model, request.publish())
    return WeightsUpdated.of(applied)


@router.post(
    "/v1/weights/restore",
    response_model=WeightsUpdated,
    summary="Restore the starting weights",
    openapi_extra=ADMIN,
)
async def restore_weights(request: RestoreWeightsRequest, weights: WeightsDep) -> WeightsUpdated:
    """Serve again the weights the model started with, read from where the server loaded them
    (its folder, or a hub model's local cache), as a new version: what an example or an
    experiment changed is undone without a restart. Refused (409) when those files changed
    since the server read them."""
    return WeightsUpdated.of(await weights.restore(request.model, request.publish()))


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
    model: Annotated[UpdatedModel, Query()] = "policy",
    version: Annotated[int | None, Query(ge=1, le=MAX_VERSION)] = None,
    pause: Annotated[PauseMode, Query()] = "keep",
) -> WeightsUpdated:
    """Upload a safetensors file as the request body (streamed to disk, applied tensor by
    tensor). Partial updates are allowed."""
    publish = Publish(version=version, pause=pause)
    body = Streamed(request.stream(), declared_size(request.headers))
    return WeightsUpdated.of(await weights.upload(body, model, publish))


@router.post(
    "/v1/weights/snapshots",
    response_model=WeightsUpdated,
    summary="Serve a published snapshot",
    openapi_extra=ADMIN,
    responses={
        409: {
            "model": ErrorResponse,
            "description": "Not the base it builds on, a checksum or digest that does not "
            "match, or a load of the model under way; the current snapshot is served on",
        },
        502: {"model": ErrorResponse, "description": "The source URL failed to answer"},
    },
)
async def load_snapshot(request: SnapshotRequest, weights: WeightsDep) -> WeightsUpdated:
    """Fetch a published snapshot (a whole checkpoint, or a delta of the snapshot served),
    check it (every tensor of a delta against its checksum, the `digest` given) and stage it
    while serving goes on, then commit it under `pause`; on a deployment of replicas, on every
    replica, and replicas that start later catch up to it before they serve. Any failure
    leaves the current snapshot served (GET /v1/weights/snapshots says why)."""
    return WeightsUpdated.of(await weights.load_snapshot(request.ask()))


@router.get(
    "/v1/weights/snapshots",
    response_model=ServedSnapshots,
    summary="What each replica serves",
    openapi_extra=ADMIN,
)
async def served_snapshots(
    weights: WeightsDep, model: Annotated[UpdatedModel, Query()] = "policy"
) -> ServedSnapshots:
    """Each replica's version, digest and snapshot of `model`, and where its last snapshot
    load stands (its stage and last error)."""
    return ServedSnapshots.of(model, await weights.served(model))


# -- collective transfer (vLLM's protocol: init -> start -> update -> finish) ---------------

_NO_ADAPTER = "The update's adapter is not served (a first push gives its config)"


@transfer_router.get(
    "", response_model=TransferState, summary="Transfer state", openapi_extra=ADMIN
)
async def transfer_state(
    weights: WeightsDep, model: Annotated[UpdatedModel, Query()] = "policy"
) -> TransferState:
    """The group state and `server_ranks`: the trainer's world size is 1 + server_ranks. On a
    replica of several, every replica's together (`server_ranks` counts all their ranks)."""
    return TransferState.of(await weights.transfer_state(model))


@transfer_router.post(
    "/init",
    response_model=TransferState,
    summary="Join the trainer",
    openapi_extra=ADMIN,
    responses={
        409: {
            "model": ErrorResponse,
            "description": "Already in a group, or no trainer joined within timeout_s",
        }
    },
)
async def transfer_init(request: TransferInit, weights: WeightsDep) -> TransferState:
    """Join the trainer's process group (the trainer, rank 0, joins it at the same time);
    returns once every rank is in, or 409 naming `timeout_s` when the trainer did not join
    in time (or could not be reached). On a replica of several, every replica joins, at
    consecutive ranks from `rank_offset`."""
    return TransferState.of(await weights.transfer_init(request.join()))


@transfer_router.post(
    "/start",
    response_model=TransferState,
    summary="Begin an update",
    openapi_extra=ADMIN,
    responses={404: {"model": ErrorResponse, "description": _NO_ADAPTER}},
)
async def transfer_start(
    request: TransferStart, weights: WeightsDep, caller: CallerDep
) -> TransferState:
    """Begin an update of the model's weights, or (`adapter`) of a LoRA adapter's tensors,
    which finish serves as its next version."""
    pushed = request.adapter
    adapter = AdapterPush(pushed.name, pushed.config, caller) if pushed is not None else None
    return TransferState.of(await weights.transfer_start(request.model, adapter))


@transfer_router.post(
    "/update", response_model=TransferState, summary="Announce tensors", openapi_extra=ADMIN
)
async def transfer_update(request: TransferUpdate, weights: WeightsDep) -> TransferState:
    """Announce the tensors of the next buckets (checked against the model: 422 names the
    field) and start receiving them; returns at once, and the trainer then broadcasts."""
    return TransferState.of(await weights.transfer_update(request.announcement()))


@transfer_router.post(
    "/finish",
    response_model=WeightsUpdated,
    summary="Commit the update",
    openapi_extra=ADMIN,
    responses={404: {"model": ErrorResponse, "description": _NO_ADAPTER}},
)
async def transfer_finish(request: TransferFinish, weights: WeightsDep) -> WeightsUpdated:
    """Wait until every announced tensor arrived (504 after `timeout_s`; 502 if the trainer
    went away), then swap them in while serving is paused (`pause`, 'keep' by default). Any
    failure leaves the served weights as they were. On a replica of several, every replica
    swaps them in under one version, or none does."""
    applied = await weights.transfer_finish(request.model, request.publish())
    return WeightsUpdated.of(applied)


@transfer_router.post(
    "/abort", response_model=TransferState, summary="Drop the update", openapi_extra=ADMIN
)
async def transfer_abort(request: TransferTarget, weights: WeightsDep) -> TransferState:
    return TransferState.of(await weights.transfer_abort(request.model))


@transfer_router.post(
    "/close", response_model=TransferState, summary="Leave the group", openapi_extra=ADMIN
)
async def transfer_close(request: TransferTarget, weights: WeightsDep) -> TransferState:
    return TransferState.of(await weights.transfer_close(request.model))


# -- pause and resume -------------------------------------------------------------------------


def _serving_state(state: GateState) -> ServingState:
    return ServingState(**dataclasses.asdict(state))


@serving_router.post(
    "/v1/pause",
    response_model=ServingState,
    summary="Pause serving",
    openapi_extra=ADMIN,
    responses=PAUSE_ERROR_RESPONSES,
)
async def pause(request: PauseRequest, weights: WeightsDep) -> ServingState:
    """New requests wait until POST /v1/resume; in-flight work meets `mode`. Returns once it
    finished, was aborted or is frozen. Pausing again with the same mode is a no-op. On a
    replica of several, every replica pauses."""
    return _serving_state(await weights.pause(request.mode))


@serving_router.post(
    "/v1/resume", response_model=ServingState, summary="Resume serving", openapi_extra=ADMIN
)
async def resume(weights: WeightsDep) -> ServingState:
    return _serving_state(await weights.resume())


@serving_router.get("/v1/serving", response_model=ServingState, summary="Pause state")
async def serving_state(registry: RegistryDep) -> ServingState:
    return _serving_state(registry.gate.state())
