"""Trajectories recorded by the OpenAI-compatible routes: record a turn, read the whole
conversation back as token sequences, attach a reward. Each key's trajectories are its own
(another key's id names another trajectory) and bounded in bytes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from app.common.containers import LogProbFields, Masks, TokenFields
from app.common.failures import Conflict, NotFound, QuotaExceeded
from app.common.routed_experts import npy_base64
from app.config_groups import TrajectorySettings
from app.engine.registry import ModelRegistry
from app.engine.types import Generation
from app.trajectories.assemble import Segment, segments
from app.trajectories.protocol import TrajectoryResponse, TrajectorySegment, TurnSpan
from app.trajectories.store import TURNS_FULL, Trajectory, TrajectoryStore, Turn

if TYPE_CHECKING:
    from rlserve_client.moe import Routing


class TrajectoryService:
    def __init__(
        self, store: TrajectoryStore, registry: ModelRegistry, settings: TrajectorySettings
    ) -> None:
        self.store = store
        self.registry = registry
        self.settings = settings

    async def record(
        self,
        trajectory_id: str,
        owner: str,
        model: str,
        prompt_ids: list[int],
        g: Generation,
        routing: Routing | None = None,
        *,
        finish_reason: str | None = None,
    ) -> int:
        """Append one completion as the trajectory's next turn; its index. With the model's
        `routing`, the generation's routed experts are kept too; `finish_reason`: the one the
        reply gave, where it is not the generation's (a chat reply's "tool_calls")."""
        routed = None
        if g.routed_experts is not None and routing is not None:
            routed = npy_base64(g.routed_experts, routing)
        turn = Turn(
            prompt_ids=list(prompt_ids),
            completion_ids=list(g.token_ids),
            log_probs=list(g.log_probs),
            versions=[[s.version, s.start, s.end] for s in g.versions or []],
            finish_reason=finish_reason or g.finish_reason,
            model=model,
            created=time.time(),
            routed_experts=routed,
        )
        index = await self.store.append(trajectory_id, owner, turn, self.settings.max_turns)
        if index == TURNS_FULL:
            raise self._full(trajectory_id)
        return index

    async def check_writable(self, trajectory_id: str, owner: str) -> None:
        """Before generating: 409 for a full trajectory, 429 for a key whose trajectories hold
        `trajectories.max_bytes_per_key` (the append checks the turns again, atomically)."""
        turns = await self.store.head(trajectory_id, owner)
        if turns is not None and turns >= self.settings.max_turns:
            raise self._full(trajectory_id)
        held, most = await self.store.usage(owner), self.settings.max_bytes_per_key
        if held >= most:
            raise QuotaExceeded(
                f"this API key's trajectories hold {held} bytes, the most "
                "trajectories.max_bytes_per_key (RLSERVE_TRAJECTORIES__MAX_BYTES_PER_KEY) "
                f"allows ({most}); delete some (DELETE /v1/trajectories/ID) or let idle ones "
                "expire",
                param="trajectory_id",
            )

    def _full(self, trajectory_id: str) -> Conflict:
        limit = self.settings.max_turns
        return Conflict(
            f"trajectory '{trajectory_id}' already has {limit} turns "
            "(trajectories.max_turns, RLSERVE_TRAJECTORIES__MAX_TURNS)",
            param="trajectory_id",
        )

    async def get(self, trajectory_id: str, owner: str) -> TrajectoryResponse:
        found = await self.store.get(trajectory_id, owner)
        if found is None:
            raise _missing(trajectory_id)
        return TrajectoryResponse(
            trajectory_id=trajectory_id,
            num_turns=len(found.turns),
            reward=found.reward,
            segments=[_wire(s) for s in segments(found.turns)],
            created_at=found.created_at,
            updated_at=found.updated_at,
            pad_token_id=self._pad_token_id(found),
        )

    def _pad_token_id(self, found: Trajectory) -> int | None:
        served = self.registry.models.get(found.turns[0].model) if found.turns else None
        return served.preparer.pad_token_id if served is not None else None

    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> None:
        if not await self.store.set_reward(trajectory_id, owner, reward):
            raise _missing(trajectory_id)

    async def delete(self, trajectory_id: str, owner: str) -> None:
        if not await self.store.delete(trajectory_id, owner):
            raise _missing(trajectory_id)

    async def reap(self) -> int:
        return await self.store.expire(time.time() - self.settings.ttl_s)


def _missing(trajectory_id: str) -> NotFound:
    return NotFound(
        f"trajectory '{trajectory_id}' does not exist or expired", param="trajectory_id"
    )


def _wire(segment: Segment) -> TrajectorySegment:
    routed = segment.routed_experts
    return TrajectorySegment(
        tokens=TokenFields(full=segment.ids),
        masks=Masks(
            all_attention_mask=[1] * len(segment.ids), all_assistant_mask=segment.assistant_mask
        ),
        log_probs=LogProbFields(full=segment.log_probs),
        turns=[
            TurnSpan(
                turn=p.turn,
                start=p.start,
                end=p.end,
                finish_reason=p.finish_reason,
                policy_versions=[list(v) for v in p.versions],
            )
            for p in segment.turns
        ],
        break_reason=segment.break_reason,
        routed_experts=None if routed is None else routed.tolist(),
    )
