"""Wire models of `POST /v1/rollouts`: the server runs the generate -> step loop itself. Steps
and trajectories are built here from the domain values of a turn (`of`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator
from rlserve_client.advantages import DEFAULT_TRAJECTORY_RETURN, TrajectoryReturn, total
from rlserve_client.sequences import SequenceSplit

from app.common.containers import (
    VERSIONS_DESCRIPTION,
    LogProbFields,
    Masks,
    TextFields,
    TokenFields,
    VersionSpan,
    wire_spans,
)
from app.common.inputs import Conversation
from app.common.protocol import (
    KeepsNull,
    Message,
    RepetitionPenalty,
    RoutedExperts,
    Seed,
    ServedName,
    ShapingFields,
    Temperature,
    TopK,
    TopP,
    WireModel,
    field_error,
    one_of,
)
from app.common.samples import log_prob_fields, mask_fields, messages, token_fields
from app.common.sampling import SamplingAsk
from app.engine.types import Generation
from app.envs.engine import RowOutcome
from app.envs.protocol import EnvConfig, step_info
from app.generation.protocol import StopList


class RolloutGeneration(ShapingFields):
    """Sampling parameters of every turn (the generate route's names and rules)."""

    model: ServedName = Field(
        default="policy",
        description="Sample with the policy, or with one of its LoRA adapters (by name).",
    )
    max_new_tokens: int | None = Field(default=None, gt=0)
    temperature: Temperature = None
    top_p: TopP = 1.0
    top_k: TopK = None
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopList | None = None
    ignore_eos: bool = Field(
        default=False, description="Keep sampling past end-of-sequence (fixed-length turns)."
    )
    seed: Seed | None = Field(
        default=None, description="Makes the whole rollout reproducible (per turn and row)."
    )
    return_routed_experts: bool = Field(
        default=False,
        description="Mixture-of-experts models: each step's routed_experts (as /v1/generate "
        "returns them, over the step's tokens.full). transformers backend only.",
    )

    def sampling_ask(self) -> SamplingAsk:
        return SamplingAsk.taken(self)


def _rollout_choices(schema: dict[str, Any]) -> None:
    """Exactly one of env and env_id; an env given here names its dataset (episodes draw
    their prompts from it) and its max_turns (episodes end); with env_id, num_envs is 1."""
    one_of(("env",), ("env_id",))(schema)
    given = {"not": {"type": "null"}}
    schema["oneOf"][0]["properties"]["env"] = {
        **given,
        "required": ["dataset", "max_turns"],
        "properties": {"dataset": given, "max_turns": given},
    }
    schema["oneOf"][1]["properties"]["num_envs"] = {"const": 1}


class RolloutRequest(WireModel):
    """Run `num_episodes` episodes: in `num_envs` temporary sessions made from `env`, or in the
    existing session `env_id`. Episodes draw their prompts from the session's dataset."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _rollout_choices(schema))

    env: EnvConfig | None = None
    env_id: str | None = None
    num_episodes: int = Field(
        ge=1, le=4096, description="A multiple of the environment's batch_size."
    )
    num_envs: int = Field(
        default=1, ge=1, le=64, description="Sessions run concurrently (env only)."
    )
    generation: RolloutGeneration = Field(default_factory=RolloutGeneration)
    trajectory_return: TrajectoryReturn = Field(
        default=DEFAULT_TRAJECTORY_RETURN,
        description="GRPO groups (repeats > 1): what is normalised across the group. sum "
        "(default), mean, max or last: one return per trajectory, its advantage on every step; "
        "steps (TorchRL MCAdvantage's default): every step reward normalised together.",
    )

    @model_validator(mode="after")
    def _check(self) -> RolloutRequest:
        if (self.env is None) == (self.env_id is None):
            raise field_error("env", "give exactly one of env and env_id")
        if self.env_id is not None and self.num_envs != 1:
            raise field_error("num_envs", "must be 1 with env_id (one session runs in order)")
        return self


class RolloutStep(KeepsNull):
    """One dialog turn of one episode, in TorchRL's container layout."""

    kept_null = ("reward",)

    text: TextFields = Field(description="response: the generated text.")
    tokens: TokenFields = Field(
        description="prompt: the observation's ids; full = prompt+response."
    )
    log_probs: LogProbFields = Field(description="response: raw model log-probs of the sample.")
    masks: Masks = Field(description="Over tokens.full; all_assistant_mask is 1 on the response.")
    reward: float | None = Field(
        description="None when a judge gave no score (info.reward.reward_error says why): the "
        "trainer decides what such a row counts for."
    )
    done: bool
    terminated: bool
    truncated: bool
    policy_version: int = Field(
        description="The weights that generated this turn's response (the first version of "
        "policy_versions when an update happened during it)."
    )
    policy_versions: list[VersionSpan] | None = Field(
        default=None, description=VERSIONS_DESCRIPTION
    )
    finish_reason: Literal["stop", "length", "abort"]
    info: dict[str, object]
    advantage: float | None = Field(
        default=None, description="GRPO groups: this step's advantage (see trajectory_return)."
    )
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="When asked (generation.return_routed_experts): per token of tokens.full "
        "but the last, the experts each layer routed it to (/v1/generate's layout).",
    )

    @classmethod
    def of(
        cls,
        prompt: list[int],
        generation: Generation,
        response_text: str,
        version: int,
        outcome: RowOutcome,
    ) -> RolloutStep:
        """The turn that answered `prompt` with `generation` (its text decoded as given)."""
        split = SequenceSplit.generated(prompt, generation.token_ids)
        return cls(
            text=TextFields(response=response_text),
            tokens=token_fields(split.token_parts()),
            log_probs=log_prob_fields(split.log_prob_parts(response=generation.log_probs)),
            masks=mask_fields(split.mask_parts()),
            reward=outcome.reward,
            done=outcome.done,
            terminated=outcome.terminated,
            truncated=outcome.truncated,
            policy_version=version,
            policy_versions=wire_spans(generation.versions),
            finish_reason=generation.finish_reason,
            info=step_info(outcome),
            routed_experts=(
                None if generation.routed_experts is None else generation.routed_experts.tolist()
            ),
        )


class Trajectory(KeepsNull):
    kept_null = ("reward",)

    env_id: str
    row: int = Field(description="The row of the session that ran the episode.")
    steps: Annotated[list[RolloutStep], Field(min_length=1)]
    reward: float | None = Field(
        description="Sum of the steps' rewards; None when a step has none (its trajectory "
        "then has no advantage and leaves its group's statistics)."
    )
    group: int | None = Field(
        default=None, description="GRPO group (repeats > 1): episodes on the same prompt."
    )
    advantage: float | None = Field(
        default=None,
        description="repeats > 1, unless trajectory_return is steps: (return - group mean) / "
        "group std (unbiased, clamped at 1e-6), as TorchRL's MCAdvantage computes it.",
    )
    history: list[Message] | None = Field(default=None, description="Chat: the final history.")

    @classmethod
    def of(
        cls, env_id: str, row: int, steps: list[RolloutStep], history: Conversation | None
    ) -> Trajectory:
        return cls(
            env_id=env_id,
            row=row,
            steps=steps,
            reward=total([s.reward for s in steps]),
            history=messages(history),
        )


class RolloutResponse(WireModel):
    trajectories: list[Trajectory]
    num_dialog_turns: int
    policy_version: int = Field(description="The policy version when the rollout finished.")
    pad_token_id: int = Field(description="The policy's padding token (for padded layouts).")
