from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Response

from app.common.disconnect import CancellableRoute, cancellable
from app.common.protocol import json_response
from app.deps import EnvsDep, OwnerDep
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

EnvId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
router = APIRouter(
    tags=["environments"], responses=ENV_ERROR_RESPONSES, route_class=CancellableRoute
)


@router.post("/v1/envs", response_model=EnvCreated, status_code=201, summary="Create a session")
async def create_env(config: EnvConfig, envs: EnvsDep, owner: OwnerDep) -> EnvCreated:
    return EnvCreated.of(await envs.create(config.to_spec(), owner))


@router.get("/v1/envs", response_model=EnvList, summary="List sessions")
async def list_envs(
    envs: EnvsDep,
    owner: OwnerDep,
    offset: Annotated[int, Query(ge=0, le=1_000_000_000)] = 0,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
) -> EnvList:
    sessions, total = await envs.page(owner, offset, limit)
    return EnvList.of(sessions, total, offset, limit)


@router.get("/v1/envs/{env_id}", response_model=EnvState, summary="Session config and state")
async def get_env(env_id: EnvId, envs: EnvsDep, owner: OwnerDep) -> EnvState:
    return EnvState.of(await envs.get(env_id, owner))


@router.delete("/v1/envs/{env_id}", status_code=204, summary="Delete a session")
async def delete_env(env_id: EnvId, envs: EnvsDep, owner: OwnerDep) -> Response:
    await envs.delete(env_id, owner)
    return Response(status_code=204)


@router.post(
    "/v1/envs/{env_id}/reset",
    response_model=ResetResponse,
    response_model_exclude_none=True,
    summary="Start new episodes",
)
@cancellable
async def reset_env(
    env_id: EnvId, request: ResetRequest, envs: EnvsDep, owner: OwnerDep
) -> Response:
    observations = await envs.reset(env_id, owner, request.to_prompts())
    return json_response(ResetResponse.of(env_id, observations))


@router.post(
    "/v1/envs/{env_id}/step",
    response_model=StepResponse,
    response_model_exclude_none=True,
    summary="Apply one assistant action per row",
)
@cancellable
async def step_env(
    env_id: EnvId,
    request: StepRequest,
    envs: EnvsDep,
    owner: OwnerDep,
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
) -> Response:
    """A step whose client goes away is cancelled with its tool runs, and changes nothing."""
    result = await envs.step(env_id, owner, request.to_acts(), idempotency_key)
    return json_response(StepResponse.of(result))
