"""The routes AReaL's own vLLM server adds (`areal/engine/vllm_ext/areal_vllm_server.py`,
AReaL 1.0.4), which its remote vLLM engine drives. They are SGLang's flow under other names:
pause, continue, a load from a path and joining the group are SGLang's handlers at AReaL's
paths; its distributed update names the tensors in one call and receives them in the next,
in the SGLang update session (buckets received while paused are committed, all at once, at
the continue)."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import DrivenUpdatesDep, RegistryDep
from app.dialects import common
from app.dialects.sglang import router as sglang
from app.dialects.sglang.protocol import Success, UpdateWeightsFromDistributed
from app.dialects.sglang.service import bucket_of
from app.errors import PAUSE_ERROR_RESPONSES, TRANSFER_ERROR_RESPONSES, WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, access

router = APIRouter(tags=["AReaL's vLLM routes"], responses=TRANSFER_ERROR_RESPONSES)
ADMIN = access(Access.ADMIN)

RESPONSES = {
    "/areal_update_weights": WEIGHTS_ERROR_RESPONSES,
    "/areal_pause_generation": PAUSE_ERROR_RESPONSES,
}
for path, endpoint, summary in (
    ("/areal_pause_generation", sglang.pause_generation, "Pause (AReaL's vLLM)"),
    ("/areal_continue_generation", sglang.continue_generation, "Continue (AReaL's vLLM)"),
    ("/areal_init_weights_update_group", sglang.init_weights_update_group, "Join (AReaL's vLLM)"),
    ("/areal_update_weights", sglang.update_weights_from_disk, "Load a path (AReaL's vLLM)"),
):
    route = next(r for r in sglang.router.routes if getattr(r, "endpoint", None) is endpoint)
    router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        response_model=getattr(route, "response_model", None),
        responses=RESPONSES.get(path),
        summary=summary,
        openapi_extra=ADMIN,
    )


@router.post(
    "/areal_set_update_weight_meta",
    response_model=Success,
    summary="Name the tensors (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def set_meta(body: UpdateWeightsFromDistributed, session: DrivenUpdatesDep) -> Success:
    await session.announce(bucket_of(body))
    return Success(message="Weight meta set")


@router.post(
    "/areal_update_weights_xccl",
    response_model=Success,
    summary="Receive the tensors (AReaL's vLLM)",
    openapi_extra=ADMIN,
)
async def update_xccl(session: DrivenUpdatesDep, registry: RegistryDep) -> Success:
    """Receive the tensors the last meta named, one broadcast each: committed at the continue
    while paused (as AReaL's loop runs it), else at once."""
    applied = await session.receive_announced()
    if applied is None:
        return Success(message="Received; applied with the rest of the update at the continue")
    version = common.label(registry, applied.versions.policy)
    return Success(message=f"Weights updated to version {version}")
