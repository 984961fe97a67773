"""Rewards: the reward model's head on given sequences, one reward per row (and per token on
request), after the same input checks as scoring, against the reward model's own tokenizer and
length. rlserve's `/v1/rewards` and the trainers' shapes (vLLM's `/classify` and `/pooling`,
SGLang's embeddings, OpenRLHF's and slime's reward calls) are vocabularies over `score`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from app.common.failures import worded
from app.common.inputs import InputPreparer, Prepared, check_num_items, text_volume
from app.common.roles import Role
from app.config_groups import LimitSettings
from app.engine.registry import ModelRegistry
from app.engine.transformers.reward import Rewarded, RewardModel
from app.rewards.protocol import (
    LoadRewardWeightsRequest,
    Reward,
    RewardsRequest,
    RewardsResponse,
    RewardWeightsLoaded,
)
from app.updates.control import WeightsControl
from app.updates.types import Publish


@dataclass(frozen=True)
class Scored:
    """One call's sequences as the reward model read them, and its outputs for each."""

    model: RewardModel
    items: list[Prepared]
    values: list[Rewarded]

    @property
    def version(self) -> int:
        """The version of the weights that scored every row."""
        return self.values[0].version if self.values else self.model.version


class RewardService:
    def __init__(
        self, registry: ModelRegistry, limits: LimitSettings, weights: WeightsControl
    ) -> None:
        self.registry = registry
        self.limits = limits
        self.weights = weights
        """The one weights control: the reward model's weights change through it as every
        served model's do (by file, delta, snapshot or transfer, on every replica)."""

    async def score(
        self,
        name: str,
        num_items: int,
        build: Callable[[InputPreparer], list[Prepared]],
        *,
        field: str,
        param: str = "model",
        cost: float = 0.0,
    ) -> Scored:
        """The reward model `name` (refused naming `param`) on the `num_items` sequences
        `build` prepares with its tokenizer (off the event loop), each checked against its
        vocabulary and length (refusals name `field[i]`)."""
        with worded({Role.MODEL: param}):
            model = self.registry.get_reward(name)
        check_num_items(num_items, self.limits.max_items_per_request, field)
        return Scored(model, *await model.read(build, field, cost))

    async def rewards(self, request: RewardsRequest) -> RewardsResponse:
        field = request.given_inputs()[0]
        scored = await self.score(
            request.model,
            request.num_items(),
            lambda preparer: preparer.sequences(request, field),
            field=field,
            cost=text_volume(request),
        )
        with_ids = field not in ("tokens", "prompt_tokens")
        outputs = [
            _reward(values, item.ids if with_ids else None, request.token_values)
            for item, values in zip(scored.items, scored.values, strict=True)
        ]
        return RewardsResponse(model=request.model, reward_version=scored.version, outputs=outputs)

    async def load_weights(self, request: LoadRewardWeightsRequest) -> RewardWeightsLoaded:
        """`POST /v1/weights/load` for the reward model: a checkpoint (or a delta of the
        served weights) checked whole before the model is touched, on every replica."""
        with worded({Role.MODEL: "path"}):  # (404 naming the setting first)
            self.registry.get_reward("reward")
        publish = Publish(version=request.version, pause="keep")
        applied = await self.weights.load(request.path, "reward", publish)
        return RewardWeightsLoaded(
            reward_version=applied.version,
            num_tensors=applied.num_tensors,
            num_bytes=applied.num_bytes,
            seconds=applied.paused_s,
            total_seconds=applied.total_s,
            digest=applied.digest,
        )


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
