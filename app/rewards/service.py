"""Rewards: the reward model's head on given sequences, one reward per row (and per token on
request), after the same input checks as scoring, against the reward model's own tokenizer and
length. rlserve's `/v1/rewards` and the trainers' shapes (vLLM's `/classify` and `/pooling`,
SGLang's embeddings, OpenRLHF's and slime's reward calls) are vocabularies over `score`."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.common.failures import Conflict
from app.common.inputs import InputPreparer, Prepared, check_num_items, text_volume
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
from app.weights.checkpoint import (
    check_finite,
    check_layout,
    checkpoint_files,
    file_work,
    read_layout,
    snapshot,
)

T = TypeVar("T")


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
        self,
        registry: ModelRegistry,
        limits: LimitSettings,
        *,
        uploads: Path,
        io_timeout_s: float,
        replicated: bool = False,
    ) -> None:
        self.registry = registry
        self.limits = limits
        self.uploads = uploads
        """Where a checkpoint is copied before it is loaded."""
        self.io_timeout_s = io_timeout_s
        self.replicated = replicated
        self._loading = asyncio.Lock()

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
        model = self.registry.get_reward(name, param)
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
        """Load a checkpoint into the reward model: copied first (a checkpoint rewritten while
        it is read is refused, 409), checked whole (names, shapes, dtypes, finite values)
        before the model is touched, then swapped in between two of its calls."""
        model = self.registry.get_reward("reward", param="path")
        if self.replicated:
            raise Conflict(
                "path: the reward model's weights load on a single server only (each replica "
                "serves its own copy); restart the replicas with the new --reward-model",
                param="path",
            )
        started = time.perf_counter()
        files = await self._files(checkpoint_files, Path(request.path), "path")
        async with self._loading:  # (one load at a time: versions rise in order)
            await self._files(self.uploads.mkdir, 0o700, True, True)
            folder = Path(await self._files(tempfile.mkdtemp, None, "load-", str(self.uploads)))
            try:
                copies = await self._files(snapshot, files, folder, "path")
                layout = await self._files(read_layout, copies, "path")
                check_layout(layout, model.layout())
                await self._files(check_finite, copies, "path")
                version = request.version or model.version + 1
                if version <= model.version:
                    raise Conflict(
                        f"version: {version} is not above the reward model's current version "
                        f"{model.version}",
                        param="version",
                    )
                num_bytes = sum(copy.stat().st_size for copy in copies)
                waited = await model.load_weights(copies, version)
            finally:  # (a copy still being written after a timeout goes with its folder)
                await asyncio.to_thread(shutil.rmtree, folder, True)
        return RewardWeightsLoaded(
            reward_version=version,
            num_tensors=len(layout),
            num_bytes=num_bytes,
            seconds=waited,
            total_seconds=time.perf_counter() - started,
        )

    async def _files(self, work: Callable[..., T], *args: Any) -> T:
        return await file_work(work, *args, timeout_s=self.io_timeout_s)


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
