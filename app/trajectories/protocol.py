"""Wire models of `/v1/trajectories`."""

from __future__ import annotations

from pydantic import Field

from app.common.protocol import Sample, WireModel


class TurnSpan(WireModel):
    turn: int
    start: int = Field(description="First token of this turn's completion in tokens.full.")
    end: int = Field(description="One past its last token.")
    finish_reason: str
    policy_versions: list[list[int]] = Field(
        description="[version, start, end] in tokens.full positions: which weights sampled "
        "which of its tokens."
    )


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


class TrajectoryResponse(WireModel):
    trajectory_id: str
    num_turns: int
    reward: float | None = None
    segments: list[TrajectorySegment]
    created_at: float
    updated_at: float
    pad_token_id: int | None = Field(
        default=None, description="The recording model's pad token (for padding segments)."
    )


class RewardRequest(WireModel):
    reward: float


class RewardResponse(WireModel):
    trajectory_id: str
    reward: float
