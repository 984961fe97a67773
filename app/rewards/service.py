"""Rewards: the reward model's head on given sequences, one reward per row (and per token on
request), after the same input checks as scoring, against the reward model's own tokenizer and
length."""

from __future__ import annotations

from app.common.inputs import check_num_items
from app.config_groups import LimitSettings
from app.engine.registry import ModelRegistry
from app.engine.reward import Rewarded
from app.rewards.protocol import Reward, RewardsRequest, RewardsResponse


class RewardService:
    def __init__(self, registry: ModelRegistry, limits: LimitSettings) -> None:
        self.registry = registry
        self.limits = limits

    async def rewards(self, request: RewardsRequest) -> RewardsResponse:
        model = self.registry.get_reward(request.model)
        field = request.given_inputs()[0]
        check_num_items(request.num_items(), self.limits.max_items_per_request, field)
        preparer = model.preparer
        items = await preparer.off_loop(preparer.checked_sequences, request, field)
        scored = await model.score([item.ids for item in items])
        with_ids = field not in ("tokens", "prompt_tokens")
        outputs = [
            _reward(values, item.ids if with_ids else None, request.token_values)
            for item, values in zip(items, scored, strict=True)
        ]
        return RewardsResponse(model=request.model, reward_version=model.version, outputs=outputs)


def _reward(values: Rewarded, token_ids: list[int] | None, per_token: bool) -> Reward:
    several = len(values.reward) > 1
    token_values = None
    if per_token:
        table = values.values.tolist()
        token_values = table if several else [row[0] for row in table]
    return Reward(
        reward=values.reward[0],
        rewards=values.reward if several else None,
        token_values=token_values,
        num_tokens=int(values.values.shape[0]),
        token_ids=token_ids,
    )
