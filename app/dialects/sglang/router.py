"""SGLang's RL routes (as sglang 0.5.23 and the older releases slime and AReaL drive answer
them), mapped onto rlserve's services. Control and weight routes need the admin key when keys
are set, as SGLang's --admin-api-key asks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Query, Response

from app.common.failures import Conflict, worded
from app.common.roles import Role
from app.deps import (
    CallerDep,
    DrivenUpdatesDep,
    GenerationDep,
    ProbeDep,
    RegistryDep,
    WeightsDep,
)
from app.dialects import common
from app.dialects.common import LORA_WORDS
from app.dialects.sglang import service
from app.dialects.sglang.protocol import (
    AbortRequest,
    BeginWeightUpdate,
    ContinueGeneration,
    DiskUpdated,
    GenerateOutput,
    GenerateRequest,
    GroupName,
    InitWeightsUpdateGroup,
    Load,
    LoadLoRAAdapter,
    Loads,
    LoRAUpdated,
    ModelInfo,
    PauseGeneration,
    PullWeights,
    StatusMessage,
    Success,
    UnloadLoRAAdapter,
    UpdateWeightsFromDisk,
    UpdateWeightsFromDistributed,
    WeightVersion,
)
from app.engine.registry import ModelRegistry
from app.errors import (
    ERROR_RESPONSES,
    PAUSE_ERROR_RESPONSES,
    TRANSFER_ERROR_RESPONSES,
    WEIGHTS_ERROR_RESPONSES,
)
from app.ops.access import Access, access
from app.updates.control import abort_in_flight
from app.updates.types import Connection, Join

router = APIRouter(tags=["SGLang dialect"], responses=ERROR_RESPONSES)
ADMIN = access(Access.ADMIN)
PAUSE_MODES = {"abort": "abort", "retract": "keep", "in_place": "keep"}


@router.post(
    "/generate",
    response_model=GenerateOutput | list[GenerateOutput],
    response_model_exclude_none=True,
    summary="Generate (SGLang)",
)
@router.put(
    "/generate",
    response_model=GenerateOutput | list[GenerateOutput],
    response_model_exclude_none=True,
    summary="Generate (SGLang, PUT)",
)
async def generate(
    request: GenerateRequest, generation: GenerationDep
) -> GenerateOutput | list[GenerateOutput]:
    """SGLang's /generate: one object for one input and n = 1, else a list (prompt-major).
    Tokens and log-probs equal /v1/generate's for the same seed (`sampling_seed`)."""
    return await service.generate(generation, request)


@router.get(
    "/health_generate",
    response_class=Response,
    summary="Healthy and generating (SGLang)",
    openapi_extra=access(Access.PUBLIC),
)
async def health_generate(probe: ProbeDep) -> Response:
    """200 once a real forward of the model answers (at most once per probe interval)."""
    await probe.require_ready()
    return Response(status_code=200)


@router.get("/model_info", response_model=ModelInfo, summary="Model info (SGLang)")
@router.get("/get_model_info", response_model=ModelInfo, include_in_schema=False)
async def model_info(registry: RegistryDep) -> ModelInfo:
    info = registry.get("policy").backend.info
    return ModelInfo(
        model_path=info.source,
        served_model_name="policy",
        tokenizer_path=info.source,
        weight_version=common.served_label(registry),
    )


@router.get("/v1/loads", response_model=Loads, summary="Load (SGLang)")
async def loads(
    registry: RegistryDep,
    include: Annotated[str | None, Query(description="Accepted: every count is given.")] = None,
) -> Loads:
    """How many requests this server holds: what a trainer polls after aborting them all
    (slime waits for 0)."""
    state = registry.gate.state()
    running, waiting = state.in_flight_generations + state.in_flight_scoring, state.waiting
    load = Load(
        num_running_reqs=running, num_waiting_reqs=waiting, num_total_reqs=running + waiting
    )
    return Loads(loads=[load])


@router.get("/get_weight_version", response_model=WeightVersion, summary="Version (SGLang)")
async def get_weight_version(registry: RegistryDep) -> WeightVersion:
    """The served version, in the trainer's count (the version its update named, also after
    it restarted: see `weight_version` of /update_weights_from_distributed)."""
    return WeightVersion(weight_version=common.served_label(registry))


@router.post(
    "/flush_cache", response_class=Response, summary="Flush cache (SGLang)", openapi_extra=ADMIN
)
@router.get(
    "/flush_cache",
    response_class=Response,
    summary="Flush cache (SGLang, GET)",
    openapi_extra=ADMIN,
)
async def flush_cache() -> Response:
    """Always succeeds: a committed weight update already leaves no cache of the old weights."""
    return Response("Cache flushed.", media_type="text/plain")


@router.post(
    "/abort_request",
    responses=TRANSFER_ERROR_RESPONSES,
    response_class=Response,
    summary="Abort all (SGLang)",
    openapi_extra=ADMIN,
)
async def abort_request(
    request: AbortRequest, registry: RegistryDep, weights: WeightsDep
) -> Response:
    """With abort_all, end every in-flight generation at its next token (each returns what
    it produced, finish_reason abort)."""
    if request.abort_all:
        await abort_in_flight(registry, weights)
    return Response(status_code=200)


@router.post(
    "/pause_generation",
    response_model=StatusMessage,
    summary="Pause (SGLang)",
    openapi_extra=ADMIN,
    responses=PAUSE_ERROR_RESPONSES,
)
async def pause_generation(
    weights: WeightsDep, body: Annotated[PauseGeneration | None, Body()] = None
) -> StatusMessage:
    await weights.pause(PAUSE_MODES[(body or PauseGeneration()).mode])  # type: ignore[arg-type]
    return StatusMessage(message="Generation paused successfully.")


@router.post(
    "/continue_generation",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=StatusMessage,
    summary="Continue (SGLang)",
    openapi_extra=ADMIN,
)
async def continue_generation(
    session: DrivenUpdatesDep, body: Annotated[ContinueGeneration | None, Body()] = None
) -> StatusMessage:
    """Commit the buckets sent while paused (all at once, or none), then resume."""
    await session.resume()
    return StatusMessage(message="Generation continued successfully.")


@router.post(
    "/init_weights_update_group",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Success,
    summary="Join the trainer (SGLang)",
    openapi_extra=ADMIN,
)
async def init_weights_update_group(
    request: InitWeightsUpdateGroup, weights: WeightsDep
) -> Success:
    """Join as SGLang's workers do: torch's tcp:// rendezvous, the store under `group_name`,
    at ranks rank_offset… (returns once every rank is in)."""
    await weights.transfer_init(
        Join(
            "policy",
            Connection(
                address=request.master_address,
                port=request.master_port,
                world_size=request.world_size,
                rank_offset=request.rank_offset,
                transport=request.backend,
                streams=1,
                timeout_s=request.timeout_s,
                style="torch",
                group_name=request.group_name,
            ),
        )
    )
    return Success(message="Succeeded to initialize custom process group.")


@router.post(
    "/destroy_weights_update_group",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Success,
    summary="Leave the group (SGLang)",
    openapi_extra=ADMIN,
)
async def destroy_weights_update_group(
    weights: WeightsDep, body: Annotated[GroupName | None, Body()] = None
) -> Success:
    await weights.transfer_close("policy")  # (which ends any update session with the group)
    return Success(message="Succeeded to destroy custom process group.")


@router.post(
    "/begin_weight_update",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Success,
    summary="Open an update (SGLang)",
    openapi_extra=ADMIN,
)
async def begin_weight_update(
    session: DrivenUpdatesDep, body: Annotated[BeginWeightUpdate | None, Body()] = None
) -> Success:
    await session.begin()
    return Success(message="Success")


@router.post(
    "/end_weight_update",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Success,
    summary="Commit the update (SGLang)",
    openapi_extra=ADMIN,
)
async def end_weight_update(session: DrivenUpdatesDep) -> Success:
    """Wait for every bucket of the session, then swap them all in at once (or none)."""
    await session.end()
    return Success(message="Success")


@router.post(
    "/update_weights_from_distributed",
    responses=TRANSFER_ERROR_RESPONSES,
    response_model=Success,
    summary="Receive tensors (SGLang)",
    openapi_extra=ADMIN,
)
async def update_weights_from_distributed(
    body: UpdateWeightsFromDistributed, session: DrivenUpdatesDep, registry: RegistryDep
) -> Success:
    """Receive one bucket the trainer broadcasts: committed at /end_weight_update inside a
    session, at /continue_generation while paused, else at once (returning then)."""
    applied = await session.receive(service.bucket_of(body))
    if applied is None:
        return Success(message="Received; applied with the rest of the update.")
    return Success(
        message=f"Succeeded to update parameter online. Weight version updated to "
        f"{common.label(registry, applied.versions.policy)}."
    )


@router.post(
    "/update_weights_from_disk",
    responses=WEIGHTS_ERROR_RESPONSES,
    response_model=DiskUpdated,
    summary="Load from a path (SGLang)",
    openapi_extra=ADMIN,
)
async def update_weights_from_disk(
    body: UpdateWeightsFromDisk, weights: WeightsDep, registry: RegistryDep
) -> DiskUpdated:
    """POST /v1/weights/load: a safetensors checkpoint the server can read, whole or not at
    all."""
    publish = common.publish(body.weight_version, "weight_version")
    with worded({Role.CHECKPOINT: "model_path"}):
        applied = await weights.load(body.model_path, "policy", publish)
    version = common.label(registry, applied.versions.policy)
    return DiskUpdated(message=f"Succeeded to update model weights. Weight version {version}.")


@router.post(
    "/pull_weights",
    responses=WEIGHTS_ERROR_RESPONSES,
    response_model=Success,
    summary="Pull published weights to a local checkpoint (slime's SGLang patch)",
    openapi_extra=ADMIN,
)
async def pull_weights(body: PullWeights, weights: WeightsDep) -> Success:
    """slime's disk delta mode: bring `local_checkpoint_dir` to `target_version` of the
    versions published under `source_dir` (full checkpoints, or deltas checked tensor by
    tensor against their checksums), leaving it as it was when any check fails; serving is
    untouched until `/update_weights_from_disk` loads it."""
    await weights.pull_published(body.local_checkpoint_dir, body.source_dir, body.target_version)
    return Success(message=f"Success. The local checkpoint holds version {body.target_version}.")


@router.post(
    "/load_lora_adapter",
    response_model=LoRAUpdated,
    responses=WEIGHTS_ERROR_RESPONSES,
    summary="Load a LoRA adapter (SGLang)",
    openapi_extra=ADMIN,
)
async def load_lora_adapter(
    request: LoadLoRAAdapter, weights: WeightsDep, registry: RegistryDep, caller: CallerDep
) -> LoRAUpdated:
    """POST /v1/adapters in SGLang's words; /generate then takes the name as `lora_path`. A
    loaded name is refused, as SGLang refuses it (unload it first, or use POST /v1/adapters
    for a next version)."""
    name = request.lora_name
    if name in registry.adapters:
        raise Conflict(
            f"lora_name: Failed to load LoRA adapter {name} because it is already loaded",
            param="lora_name",
        )
    with worded(LORA_WORDS):
        await weights.load_adapter(name, request.lora_path, caller=caller)
    return _adapters(registry)


@router.post(
    "/unload_lora_adapter",
    response_model=LoRAUpdated,
    responses=WEIGHTS_ERROR_RESPONSES,
    summary="Unload a LoRA adapter (SGLang)",
    openapi_extra=ADMIN,
)
async def unload_lora_adapter(
    request: UnloadLoRAAdapter, weights: WeightsDep, registry: RegistryDep, caller: CallerDep
) -> LoRAUpdated:
    with worded(LORA_WORDS):
        await weights.unload_adapter(request.lora_name, caller=caller)
    return _adapters(registry)


def _adapters(registry: ModelRegistry) -> LoRAUpdated:
    served = {name: adapter.source for name, adapter in sorted(registry.adapters.items())}
    return LoRAUpdated(loaded_adapters=served)
