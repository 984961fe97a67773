from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancel_on_disconnect
from app.common.protocol import json_response
from app.deps import OwnerDep, RolloutsDep
from app.errors import ENV_ERROR_RESPONSES
from app.rollouts.protocol import RolloutRequest, RolloutResponse

router = APIRouter(tags=["rollouts"], responses=ENV_ERROR_RESPONSES)


@router.post(
    "/v1/rollouts",
    response_model=RolloutResponse,
    response_model_exclude_none=True,
    summary="Run whole episodes on the server",
)
async def rollouts(
    request: RolloutRequest, service: RolloutsDep, owner: OwnerDep, http_request: Request
) -> Response:
    """Generate with the policy and step the environment until every episode ends; returns
    the trajectories in the shape the client's `collect` yields, with group-normalised
    advantages when the environment has `repeats` > 1."""
    result = await cancel_on_disconnect(http_request, service.run(request, owner))
    return json_response(result)
