"""Wire models of `/v1/trajectories`."""

from __future__ import annotations

from pydantic import Field
from rlserve_client import types as containers

from app.common.protocol import Sample, WireModel


class TurnSpan(containers.TurnSpan, WireModel):
    pass


class TrajectorySegment(Sample):
    """Turns whose prompts extend each other token for token, as one sequence:
    `masks.all_assistant_mask` is 1 on the tokens the policy sampled, `log_probs.full` holds
    their raw log-probs (0.0 on every other token: the policy did not sample those)."""

    turns: list[TurnSpan]
    break_reason: str | None = Field(
        default=None,
        description="Why this segment does not continue the previous one (where the "
        "re-templated history stopped matching the recorded tokens).",
    )


class TrajectoryResponse(containers.RecordedTrajectory, WireModel):
    segments: list[TrajectorySegment]  # type: ignore[assignment]  # the server's segments


class RewardRequest(WireModel):
    reward: float


class RewardResponse(WireModel):
    trajectory_id: str
    reward: float
