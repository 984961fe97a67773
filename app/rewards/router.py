from fastapi import APIRouter

from app.common.disconnect import cancellable
from app.deps import RewardsDep
from app.errors import REWARD_ERROR_RESPONSES, REWARD_WEIGHTS_ERROR_RESPONSES
from app.ops.access import Access, access
from app.rewards.protocol import (
    LoadRewardWeightsRequest,
    RewardsRequest,
    RewardsResponse,
    RewardWeightsLoaded,
)

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


@router.post(
    "/v1/rewards/weights",
    response_model=RewardWeightsLoaded,
    summary="Load the reward model's weights from a path",
    responses=REWARD_WEIGHTS_ERROR_RESPONSES,
    openapi_extra=access(Access.ADMIN),
)
async def load_reward_weights(
    request: LoadRewardWeightsRequest, service: RewardsDep
) -> RewardWeightsLoaded:
    """Load a safetensors checkpoint (HF layout, any subset of the reward model's parameters)
    or a delta of its served weights, which the server can read, into the reward model as its
    next version (`reward_version` of every later reward), on every replica: `POST
    /v1/weights/load` with model 'reward'. Its calls wait for the swap only; a checkpoint that
    does not fit the model is refused before it is touched."""
    return await service.load_weights(request)
