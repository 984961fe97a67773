from fastapi import APIRouter

from app.common.disconnect import cancellable
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES
from app.rewards.protocol import RewardsRequest, RewardsResponse

router = APIRouter(tags=["rewards"], responses=REWARD_ERROR_RESPONSES)


@router.post(
    "/v1/rewards",
    response_model=RewardsResponse,
    response_model_exclude_none=True,
    summary="Score sequences with the reward model",
)
@cancellable
async def rewards(request: RewardsRequest, service: RewardsDep) -> RewardsResponse:
    """The reward model's output for each sequence (its head at the last token; per token on
    request), batched with other requests' rows. 404 naming --reward-model when the server
    serves none."""
    return await service.rewards(request)
