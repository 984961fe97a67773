"""Wire models of `/v1/trajectories`."""

from __future__ import annotations

from pydantic import Field
from rlserve_client import types as containers

from app.common.containers import Sample
from app.common.protocol import RoutedExperts, WireModel


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
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="Mixture-of-experts policies, when the server returns routed experts: per "
        "token of tokens.full but the last, the experts each layer routed it to "
        "[num_hidden_layers][num_experts_per_tok], as /v1/generate's. Each token's routing is "
        "that of the turn that first fed it to the model: the turn's own routing for the "
        "tokens it sampled. Replay it with /v1/logprobs' routed_experts or rlserve_client.moe.",
    )


class TrajectoryResponse(containers.RecordedTrajectory, WireModel):
    segments: list[TrajectorySegment]  # type: ignore[assignment]  # the server's segments


class RewardRequest(WireModel):
    reward: float


class RewardResponse(WireModel):
    trajectory_id: str
    reward: float
