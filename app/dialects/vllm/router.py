"""vLLM's RL routes (as `vllm serve` 0.32 answers them with VLLM_SERVER_DEV_MODE=1), mapped
onto rlserve's services: TRL's `VLLMClient`, SkyRL and prime-rl point here unchanged. Control
and weight routes need the admin key when keys are set (vLLM leaves them open)."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Query

from app.common.failures import Conflict, Unsupported, worded
from app.common.roles import Role
from app.deps import (
    GenerationDep,
    RegistryDep,
    SettingsDep,
    WeightsDep,
)
from app.dialects import common
from app.dialects.vllm import service
from app.dialects.vllm.protocol import (
    Aborted,
    AbortRequests,
    InferenceGenerateRequest,
    InferenceGenerateResponse,
    IsPaused,
    Message,
    PrefixCacheReset,
    Status,
    WorldSize,
)
from app.dialects.vllm.transfer import (
    CollectiveRpc,
    DeltaInitInfo,
    Fetched,
    FetchedVersion,
    FetchWeights,
    FinishWeightUpdate,
    InitBroadcaster,
    InitWeightTransfer,
    NewVersion,
    RpcResults,
    StartRpc,
    StartWeightUpdate,
    UpdateRpc,
    UpdateWeights,
    VersionConfirmed,
    WeightInfo,
)
from app.errors import (
    ERROR_RESPONSES,
    PAUSE_ERROR_RESPONSES,
    TRANSFER_ERROR_RESPONSES,
    WEIGHTS_ERROR_RESPONSES,
)
from app.ops.access import Access, access
from app.updates.control import WeightsControl, abort_in_flight
from app.updates.types import Announcement, Connection, Join, Publish

router = APIRouter(tags=["vLLM dialect"], responses=ERROR_RESPONSES)
ADMIN = access(Access.ADMIN)


@router.post(
    "/pause",
    response_model=Status,
    summary="Pause (vLLM)",
    openapi_extra=ADMIN,
    responses=PAUSE_ERROR_RESPONSES,
)
async def pause(
    weights: WeightsDep,
    mode: Annotated[Literal["abort", "wait", "keep"], Query()] = "abort",
    clear_cache: Annotated[
        bool, Query(description="Accepted: rlserve keeps no stale cache.")
    ] = True,
) -> Status:
    """POST /v1/pause with vLLM's default mode, abort."""
    await weights.pause(mode)
    return Status(status="paused")


@router.post("/resume", response_model=Status, summary="Resume (vLLM)", openapi_extra=ADMIN)
async def resume(weights: WeightsDep) -> Status:
    await weights.resume()
    return Status(status="resumed")


@router.get("/is_paused", response_model=IsPaused, summary="Paused? (vLLM)")
async def is_paused(registry: RegistryDep) -> IsPaused:
    return IsPaused(is_paused=registry.gate.state().paused)


@router.post(
    "/abort_requests",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Aborted,
    summary="Abort all (vLLM)",
    openapi_extra=ADMIN,
)
async def abort_requests(
    registry: RegistryDep, weights: WeightsDep, body: AbortRequests | None = None
) -> Aborted:
    """End every in-flight generation at its next token (each returns what it produced)."""
    return Aborted(aborted=await abort_in_flight(registry, weights))


@router.post(
    "/reset_prefix_cache",
    response_model=PrefixCacheReset,
    summary="Reset prefix cache (vLLM)",
    openapi_extra=ADMIN,
)
async def reset_prefix_cache(
    reset_running_requests: Annotated[bool, Query()] = False,
    reset_external: Annotated[bool, Query()] = False,
) -> PrefixCacheReset:
    """Always succeeds: a committed weight update already leaves no cache of the old weights."""
    return PrefixCacheReset(success=True)


@router.get("/get_world_size", response_model=WorldSize, summary="Transfer ranks (vLLM)")
async def get_world_size(
    weights: WeightsDep, include_dp: Annotated[bool, Query()] = True
) -> WorldSize:
    return WorldSize(world_size=await common.served_ranks(weights))


@router.get("/server_info", response_model=dict[str, Any], summary="Server info (vLLM and SGLang)")
async def server_info(
    registry: RegistryDep,
    settings: SettingsDep,
    weights: WeightsDep,
    config_format: Annotated[Literal["text", "json"], Query()] = "json",
) -> dict[str, Any]:
    """vLLM's `vllm_config` (model, weight transfer) and SGLang's flat server fields."""
    return common.server_info(registry, settings, await common.served_ranks(weights))


@router.post(
    "/init_weight_transfer_engine",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Message,
    summary="Join the trainer (vLLM)",
    openapi_extra=ADMIN,
)
async def init_weight_transfer_engine(request: InitWeightTransfer, weights: WeightsDep) -> Message:
    """Join the trainer's group as vLLM's workers do: its stateless group (gloo on CPU,
    vLLM's NCCL communicator on a GPU), packed buckets as vLLM cuts them when `packed`. Or,
    given SkyRL's checkpoint-delta init info, take its versions from the folder it
    publishes to (POST /fetch_weights, then POST /update_weights naming the version)."""
    info = request.init_info
    if isinstance(info, DeltaInitInfo):
        await _publishing(weights)
        return Message(message="Weight transfer initialized (checkpoint deltas)")
    await weights.transfer_init(
        Join(
            "policy",
            Connection(
                address=info.master_address,
                port=info.master_port,
                world_size=info.world_size,
                rank_offset=info.rank_offset,
                bucket_bytes=info.packed_buffer_size_bytes,
                streams=1,
                timeout_s=info.timeout_s,
                style="vllm",
                packing="vllm" if info.packed else "announced",
            ),
        )
    )
    return Message(message="Weight transfer initialized")


@router.post(
    "/init_broadcaster",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Status,
    summary="Join prime-rl's weight broadcast",
    openapi_extra=ADMIN,
)
async def init_broadcaster(request: InitBroadcaster, weights: WeightsDep) -> Status:
    """Join prime-rl's trainer's group as its vLLM workers do (vLLM's stateless group: gloo
    on CPU, vLLM's NCCL communicator on a GPU): each POST /update_weights then receives its
    broadcast, the tensors named over the group itself, and swaps them in whole."""
    await weights.transfer_init(
        Join(
            "policy",
            Connection(
                address=request.host,
                port=request.port,
                world_size=request.inference_world_size + 1,
                rank_offset=request.rank_offset + 1,
                streams=1,
                timeout_s=request.timeout,
                style="vllm",
                packing="in_band",
            ),
        )
    )
    return Status(status="ok")


@router.post(
    "/shutdown_weight_transfer_engine",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Message,
    summary="Leave the group (vLLM)",
    openapi_extra=ADMIN,
)
async def shutdown_weight_transfer_engine(weights: WeightsDep) -> Message:
    await weights.transfer_close("policy")
    return Message(message="Weight transfer shut down")


@router.post(
    "/start_weight_update",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Message,
    summary="Begin an update (vLLM)",
    openapi_extra=ADMIN,
)
async def start_weight_update(
    weights: WeightsDep, body: Annotated[StartWeightUpdate | None, Body()] = None
) -> Message:
    if not (await weights.session()).published:  # (a published version loads at its update)
        await weights.transfer_start("policy")
    return Message(message="Weight update started")


@router.post(
    "/fetch_weights",
    responses=WEIGHTS_ERROR_RESPONSES,
    response_model=Fetched,
    summary="Pull a published version (SkyRL's)",
    openapi_extra=ADMIN,
)
async def fetch_weights(request: FetchWeights, weights: WeightsDep) -> Fetched:
    """SkyRL's checkpoint-delta backend: bring the server's local checkpoint to
    `target_version` of the deltas SkyRL publishes under `sync_dir` (each checked tensor by
    tensor against its checksum; a bad one leaves the local checkpoint as it was), while
    serving goes on; POST /update_weights then loads it."""
    with worded({Role.PUBLISHED: "sync_dir"}):
        await weights.pull_published(None, request.sync_dir, request.target_version, "skyrl")
    return Fetched(result=[FetchedVersion(target_version=request.target_version)])


@router.post(
    "/update_weights",
    responses={**WEIGHTS_ERROR_RESPONSES, **TRANSFER_ERROR_RESPONSES},
    response_model=Message,
    summary="Announce tensors (vLLM)",
    openapi_extra=ADMIN,
)
async def update_weights(
    request: UpdateWeights, weights: WeightsDep, registry: RegistryDep
) -> Message:
    """Announce the tensors the trainer broadcasts next (checked against the model; names
    the field of a mismatch) and receive them in the background; or, given `weight_dir`
    (prime-rl's), load that checkpoint as POST /v1/weights/load, whole or not at all, or,
    in prime-rl's broadcast group (POST /init_broadcaster), receive its next broadcast and
    swap it in whole (prime-rl's workers then ignore the folder)."""
    if (delta := request.delta) is not None:
        with worded({Role.PUBLISHED: "update_info.sync_dir", Role.CHECKPOINT: "update_info"}):
            local = await weights.pull_published(
                None, delta.sync_dir, delta.target_version, "skyrl"
            )
            applied = await weights.load(local, "policy", Publish())
        version = common.label(registry, applied.versions.policy)
        return Message(message=f"Weights loaded as version {version}")
    if request.weight_dir is not None:
        if await _broadcast_group(weights):
            await weights.transfer_start("policy")
            await weights.transfer_update(Announcement("policy", [], [], [], packing="in_band"))
            applied = await weights.transfer_finish("policy", Publish())
        else:
            with worded({Role.CHECKPOINT: "weight_dir"}):
                applied = await weights.load(request.weight_dir, "policy", Publish())
        version = common.label(registry, applied.versions.policy)
        return Message(message=f"Weights loaded as version {version}")
    for info in request.infos:
        await weights.transfer_update(info.announcement())
    return Message(message="Weights updated")


async def _broadcast_group(weights: WeightsControl) -> bool:
    """Whether the policy is in prime-rl's broadcast group (joined by /init_broadcaster)
    whose trainer is still there: prime-rl has no call that leaves the group, so a group
    whose trainer is gone is closed here, and the folder loads."""
    try:
        state = await weights.transfer_prune("policy")
    except Unsupported:
        return False
    return state.state != "idle" and state.packing == "in_band"


@router.post(
    "/finish_weight_update",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Message,
    summary="Commit the update (vLLM)",
    openapi_extra=ADMIN,
)
async def finish_weight_update(
    weights: WeightsDep, body: Annotated[FinishWeightUpdate | None, Body()] = None
) -> Message:
    """Wait for every announced tensor, then swap them all in at once (or none)."""
    if (await weights.session()).published:  # (loaded at its update)
        return Message(message="Weight update finished")
    given = body.weight_version if body is not None else None
    await weights.transfer_finish("policy", common.publish(given, "weight_version"))
    return Message(message="Weight update finished")


async def _publishing(weights: WeightsControl) -> None:
    """Record that the policy's trainer publishes its versions (on every replica)."""
    for _ in range(8):  # (compare-and-set: a write between the read and the swap reads again)
        read = await weights.session()
        if await weights.swap_session(read.serial, replace(read, published=True)) is not None:
            return
    raise Conflict("init_info: the update session kept changing; send it again")


@router.post(
    "/collective_rpc",
    responses={**WEIGHTS_ERROR_RESPONSES, **TRANSFER_ERROR_RESPONSES},
    response_model=RpcResults,
    summary="Run a worker method (vLLM, SkyRL's)",
    openapi_extra=ADMIN,
)
async def collective_rpc(request: CollectiveRpc, weights: WeightsDep) -> RpcResults:
    """vLLM's dev-mode `/collective_rpc`, for the worker methods SkyRL's trainer drives its
    weight sync with (its NewInferenceWorkerWrap): start, the tensors of its broadcast, finish.
    Each answers as the vLLM route of the same step; the results, one per server rank."""
    call = request.root
    if isinstance(call, StartRpc):
        await weights.transfer_start("policy")
    elif isinstance(call, UpdateRpc):
        await weights.transfer_update(call.kwargs.update_info.announcement())
    else:
        await weights.transfer_finish("policy", common.publish(None, "weight_version"))
    return RpcResults(results=[None] * await common.served_ranks(weights))


@router.post(
    "/update_weight_version",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=VersionConfirmed,
    summary="Confirm the version (vLLM and SGLang)",
    openapi_extra=ADMIN,
)
async def update_weight_version(request: NewVersion, registry: RegistryDep) -> VersionConfirmed:
    """rlserve's versions move with the weights: this confirms the current one (409 for
    another: give the version to the update that brings the weights instead)."""
    version = common.confirm_version(registry, request.new_version)
    return VersionConfirmed(new_version=version, message=f"Weight version updated to {version}")


@router.get("/weight_info", response_model=WeightInfo, summary="Weight version (vLLM)")
async def weight_info(registry: RegistryDep) -> WeightInfo:
    """The served version, in the trainer's count (see POST /finish_weight_update)."""
    return WeightInfo(weight_version=common.served_label(registry))


@router.post(
    "/inference/v1/generate",
    response_model=InferenceGenerateResponse,
    response_model_exclude_none=True,
    summary="Generate from tokens (vLLM)",
)
async def inference_generate(
    request: InferenceGenerateRequest, generation: GenerationDep, settings: SettingsDep
) -> InferenceGenerateResponse:
    """vLLM's token-in, token-out generation: the same tokens and log-probs as /v1/generate
    for the same seed."""
    routed = settings.models.return_routed_experts
    return await service.generate(generation, request, routed_experts=routed)
