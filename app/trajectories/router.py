from typing import Annotated

from fastapi import APIRouter, Path, Response

from app.common.protocol import json_response
from app.deps import OwnerDep, TrajectoriesDep
from app.errors import ERROR_RESPONSES, ErrorResponse
from app.trajectories.protocol import RewardRequest, RewardResponse, TrajectoryResponse

router = APIRouter(tags=["trajectories"])
TrajectoryId = Annotated[str, Path(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]
RESPONSES = {
    **ERROR_RESPONSES,
    404: {"model": ErrorResponse, "description": "Unknown or expired trajectory"},
}


@router.get(
    "/v1/trajectories/{trajectory_id}",
    response_model=TrajectoryResponse,
    response_model_exclude_none=True,
    responses=RESPONSES,
    summary="A recorded trajectory as token sequences",
)
async def get_trajectory(
    trajectory_id: TrajectoryId, service: TrajectoriesDep, owner: OwnerDep
) -> Response:
    """Every completion recorded under this id (`trajectory_id` on the OpenAI routes), as one
    token sequence per segment with its assistant mask and raw log-probs."""
    return json_response(await service.get(trajectory_id, owner))


@router.post(
    "/v1/trajectories/{trajectory_id}/reward",
    response_model=RewardResponse,
    responses=RESPONSES,
    summary="Attach a reward to a trajectory",
)
async def set_reward(
    trajectory_id: TrajectoryId, body: RewardRequest, service: TrajectoriesDep, owner: OwnerDep
) -> RewardResponse:
    await service.set_reward(trajectory_id, owner, body.reward)
    return RewardResponse(trajectory_id=trajectory_id, reward=body.reward)


@router.delete(
    "/v1/trajectories/{trajectory_id}",
    status_code=204,
    responses=RESPONSES,
    summary="Delete a trajectory",
)
async def delete_trajectory(
    trajectory_id: TrajectoryId, service: TrajectoriesDep, owner: OwnerDep
) -> Response:
    await service.delete(trajectory_id, owner)
    return Response(status_code=204)
