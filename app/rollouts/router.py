from fastapi import APIRouter, Response

from app.common.disconnect import CancellableRoute, cancellable
from app.common.protocol import json_response
from app.deps import OwnerDep, RolloutsDep
from app.errors import ENV_ERROR_RESPONSES
from app.rollouts.protocol import RolloutRequest, RolloutResponse

router = APIRouter(tags=["rollouts"], responses=ENV_ERROR_RESPONSES, route_class=CancellableRoute)


@router.post(
    "/v1/rollouts",
    response_model=RolloutResponse,
    response_model_exclude_none=True,
    summary="Run whole episodes on the server",
)
@cancellable
async def rollouts(request: RolloutRequest, service: RolloutsDep, owner: OwnerDep) -> Response:
    """Generate with the policy and step the environment until every episode ends; returns
    the trajectories in the shape the client's `collect` yields, with group-normalised
    advantages when the environment has `repeats` > 1."""
    return json_response(await service.run(request, owner))
