from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from app.common.disconnect import cancel_on_disconnect
from app.deps import EnvsDep, OwnerDep
from app.envs.episodes import Act
from app.envs.protocol import (
    EnvConfig,
    EnvCreated,
    EnvList,
    EnvState,
    ResetRequest,
    ResetResponse,
    StepRequest,
    StepResponse,
)
from app.errors import ENV_ERROR_RESPONSES

router = APIRouter(tags=["environments"], responses=ENV_ERROR_RESPONSES)


@router.post("/v1/envs", response_model=EnvCreated, status_code=201, summary="Create a session")
async def create_env(config: EnvConfig, envs: EnvsDep, owner: OwnerDep) -> EnvCreated:
    return await envs.create(config, owner)


@router.get("/v1/envs", response_model=EnvList, summary="List sessions")
async def list_envs(
    envs: EnvsDep,
    owner: OwnerDep,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> EnvList:
    return await envs.page(owner, offset, limit)


@router.get("/v1/envs/{env_id}", response_model=EnvState, summary="Session config and state")
async def get_env(env_id: str, envs: EnvsDep, owner: OwnerDep) -> EnvState:
    return await envs.get(env_id, owner)


@router.delete("/v1/envs/{env_id}", status_code=204, summary="Delete a session")
async def delete_env(env_id: str, envs: EnvsDep, owner: OwnerDep) -> Response:
    await envs.delete(env_id, owner)
    return Response(status_code=204)


@router.post(
    "/v1/envs/{env_id}/reset",
    response_model=ResetResponse,
    response_model_exclude_none=True,
    summary="Start new episodes",
)
async def reset_env(
    env_id: str, request: ResetRequest, envs: EnvsDep, owner: OwnerDep
) -> ResetResponse:
    return await envs.reset(env_id, owner, request)


@router.post(
    "/v1/envs/{env_id}/step",
    response_model=StepResponse,
    response_model_exclude_none=True,
    summary="Apply one assistant action per row",
)
async def step_env(
    env_id: str,
    request: StepRequest,
    envs: EnvsDep,
    owner: OwnerDep,
    http_request: Request,
    idempotency_key: Annotated[
        str | None,
        Header(
            min_length=1,
            max_length=128,
            pattern=r"^[\x21-\x7e]+$",
            description="Any unique string per step (e.g. a UUID). Sent again with the same "
            "actions, the last applied step is answered as it was instead of applied twice: "
            "a client may retry a step whose answer it never got.",
        ),
    ] = None,
) -> StepResponse:
    """A step whose client goes away is cancelled with its tool runs, and changes nothing."""
    actions = [Act.from_wire(a) for a in request.actions]
    stepping = envs.step(env_id, owner, actions, idempotency_key)
    return await cancel_on_disconnect(http_request, stepping)
