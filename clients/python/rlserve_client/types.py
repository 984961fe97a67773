"""Typed results: the response bodies as pydantic models mirroring TorchRL's containers
(text / tokens / masks / log_probs / history, each with prompt / response / full). The server's
wire models of these containers extend the ones here, so both read one definition. The
records results are made of (`Sample`, `Step`, `Trajectory`, ...) are `rlserve_client.records`',
re-exported here.

Unknown fields are kept (a newer server never breaks an older client); `.to_tensordict()`
needs the `[torch]` extra."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from rlserve_client.records import (
    History,
    LogProbs,
    Masks,
    Message,
    Result,
    Sample,
    Step,
    Text,
    Tokens,
    TopLogProbs,
    Trajectory,
    VersionSpan,
)

if TYPE_CHECKING:
    from tensordict import TensorDictBase

__all__ = [
    "Adapter",
    "Adapters",
    "EnvCreated",
    "EnvList",
    "EnvState",
    "GenerateResult",
    "Health",
    "History",
    "Json",
    "KLResult",
    "KLSample",
    "LogProbs",
    "LogProbsResult",
    "Masks",
    "Message",
    "MismatchReport",
    "ModelCard",
    "Models",
    "Observation",
    "ProcessedLogProbs",
    "Ready",
    "RecordedTrajectory",
    "ReplicaWeights",
    "ResetResult",
    "Result",
    "Reward",
    "RewardWeightsLoaded",
    "RewardsResult",
    "RolloutResult",
    "RowState",
    "Sample",
    "ScoredSample",
    "ServedSnapshots",
    "ServingState",
    "Step",
    "StepOutput",
    "StepResult",
    "Text",
    "Tokens",
    "TopLogProbs",
    "Trajectory",
    "TrajectorySegment",
    "TransferState",
    "TurnSpan",
    "VersionSpan",
    "WeightsUpdated",
    "WeightsVersion",
]


def _pad_id(given: int | None, served: int | None) -> int:
    """The pad token: the caller's, else the one the server reported (never a guessed id)."""
    if given is not None:
        return given
    if served is None:
        raise ValueError("the server did not report pad_token_id: pass pad_token_id=")
    return served


def _to_tensordict(samples: Sequence[Sample], padded: bool, pad_token_id: int) -> TensorDictBase:
    from rlserve_client.tensordicts import samples_to_tensordict

    return samples_to_tensordict(samples, padded=padded, pad_token_id=pad_token_id)


class GenerateResult(Result):
    policy_version: int
    model: str
    pad_token_id: int | None = None
    outputs: list[list[Sample]]

    @property
    def samples(self) -> list[Sample]:
        """Every sample, input by input (the `n` samples of an input are adjacent)."""
        return [sample for group in self.outputs for sample in group]

    def to_tensordict(
        self, *, padded: bool = True, pad_token_id: int | None = None
    ) -> TensorDictBase:
        """Batch `[num_inputs * n]`; see `rlserve_client.tensordicts` for the layout. Tokens
        pad with the model's pad token, as the server reports it."""
        pad = _pad_id(pad_token_id, self.pad_token_id)
        return _to_tensordict(self.samples, padded, pad)


class ProcessedLogProbs(Result):
    log_probs: list[float | None]
    truncated_mass: list[float | None]


class MismatchReport(Result):
    difference: list[float | None]
    max_abs: float
    mean_abs: float
    effective_sample_size: float
    num_tokens: int
    num_beyond_threshold: int
    threshold: float


class ScoredSample(Sample):
    """A scored sequence and the extras its request asked for, one row per token of `span`
    (null rows: nothing predicted there, or a token the processed distribution removed)."""

    span: Literal["response", "full"] | None = None
    processed: ProcessedLogProbs | None = None
    token_id_log_probs: list[list[float] | None] | None = None
    mismatch: MismatchReport | None = None


class LogProbsResult(Result):
    policy_version: int
    model: str
    outputs: list[ScoredSample]
    pad_token_id: int | None = None

    def to_tensordict(
        self, *, padded: bool = True, pad_token_id: int | None = None
    ) -> TensorDictBase:
        pad = _pad_id(pad_token_id, self.pad_token_id)
        return _to_tensordict(self.outputs, padded, pad)


class TurnSpan(Result):
    turn: int
    start: int = Field(description="First token of this turn's completion in tokens.full.")
    end: int = Field(description="One past its last token.")
    finish_reason: str
    policy_versions: list[list[int]] = Field(
        description="[version, start, end] in tokens.full positions: which weights sampled "
        "which of its tokens."
    )


class TrajectorySegment(Sample):
    """Turns whose prompts extend each other, as one sequence (see the server's docs)."""

    turns: list[TurnSpan]
    break_reason: str | None = None


class RecordedTrajectory(Result):
    """Completions recorded by the OpenAI routes under one trajectory id."""

    trajectory_id: str
    num_turns: int
    reward: float | None = None
    segments: list[TrajectorySegment]
    created_at: float
    updated_at: float
    pad_token_id: int | None = Field(
        default=None, description="The recording model's pad token (for padding segments)."
    )

    def to_tensordict(
        self, *, padded: bool = True, pad_token_id: int | None = None
    ) -> TensorDictBase:
        """Batch `[num_segments]`: tokens, assistant mask and log-probs of each segment, in
        the layout of `LogProbsResult.to_tensordict` (padded with the model's pad token)."""
        return _to_tensordict(self.segments, padded, _pad_id(pad_token_id, self.pad_token_id))


class KLSample(Result):
    tokens: Tokens
    mask: list[int]
    kl: list[float]
    policy_log_probs: list[float]
    ref_log_probs: list[float]
    kl_sum: float
    kl_mean: float
    num_counted: int
    shaped_rewards: list[float] | None = None


class KLResult(Result):
    policy_version: int
    estimator: str
    outputs: list[KLSample]


class Reward(Result):
    reward: float
    rewards: list[float] | None = None
    token_values: list[float] | list[list[float]] | None = None
    num_tokens: int
    token_ids: list[int] | None = None


class RewardsResult(Result):
    model: str
    reward_version: int
    outputs: list[Reward]


class RewardWeightsLoaded(Result):
    reward_version: int
    num_tensors: int
    num_bytes: int
    seconds: float = 0.0
    """The swap's time: the longest a reward model's call waited for it."""
    total_seconds: float = 0.0
    digest: str | None = None
    """The reward model's weight digest after the load."""


class Health(Result):
    status: str
    model_status: str


class Ready(Result):
    ready: bool
    policy_version: int
    digests: dict[str, str] = Field(default_factory=dict)
    """Each model's weight digest (`weight_delta.weights_digest` of the weights served)."""


class ModelCard(Result):
    """OpenAI's model object (`id`, `object`, `created`, `owned_by`) with rlserve's fields."""

    id: str = Field(description="The name requests use (OpenAI's field; equals name).")
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "rlserve"
    name: str
    source: str
    backend: str
    dtype: str
    device: str
    max_model_len: int
    vocab_size: int
    builtin: bool
    pad_token_id: int
    root: str | None = Field(
        default=None, description="Where its weights came from (vLLM's field)."
    )
    parent: str | None = Field(
        default=None, description="A LoRA adapter's base model (vLLM's field); null for a model."
    )


class Adapter(Result):
    """A served LoRA adapter: requests name it as their `model`."""

    name: str
    version: int
    base: str
    source: str
    rank: int
    num_layers: int
    num_parameters: int
    paused: Literal["wait", "abort", "keep"] | None = None
    in_flight: int = 0
    waiting: int = 0


class Adapters(Result):
    adapters: list[Adapter]


class Models(Result):
    models: list[ModelCard]
    policy_version: int


class WeightsVersion(Result):
    policy_version: int
    reference_version: int


class WeightsUpdated(WeightsVersion):
    model: str
    version: int | None = None
    """The version `model` serves after the update (any served model's: the reward and judge
    models' too); None from a server that does not say."""
    num_tensors: int
    num_bytes: int
    seconds: float = 0.0
    """How long serving was paused for the swap."""
    total_seconds: float = 0.0
    adapter: str | None = None
    """The LoRA adapter the update pushed (`WeightSync.send_adapter`), and its new version."""
    adapter_version: int | None = None
    digest: str | None = None
    """The model's weight digest after the update (None: its engine cannot show it)."""
    sent_bytes: int | None = None
    """For a delta: the bytes of its compressed changes (against `num_bytes` rebuilt)."""
    snapshot: str | None = None
    """The published snapshot now served, when the update was one."""


class ReplicaWeights(Result):
    replica: str | None = None
    version: int
    """-1: the replica did not answer (`last_error` says why)."""
    digest: str | None = None
    snapshot: str | None = None
    stage: str = "serving"
    last_error: str | None = None


class ServedSnapshots(Result):
    model: str
    replicas: list[ReplicaWeights]


class ServingState(Result):
    paused: bool
    mode: str | None = None
    paused_by: str | None = None
    in_flight_generations: int = 0
    in_flight_scoring: int = 0
    waiting: int = 0


class TransferState(Result):
    model: str
    state: str
    server_ranks: int
    transport: str | None = None
    world_size: int | None = None
    announced_bytes: int = 0
    last_error: str | None = None
    replicas: int = 1


class EnvCreated(Result):
    env_id: str
    config: dict[str, Any]


class Observation(Result):
    history: list[Message] | None = None
    text: str | None = None
    prompt_text: str
    prompt_tokens: list[int]
    hash: int | None = None


class ResetResult(Result):
    env_id: str
    observations: list[Observation]


class StepOutput(Result):
    observation: Observation
    reward: float | None
    """None when a judge gave no score (`info["reward"]["reward_error"]` says why)."""
    done: bool
    terminated: bool
    truncated: bool
    info: dict[str, Any]


class StepResult(Result):
    env_id: str
    policy_version: int
    outputs: list[StepOutput]


class RowState(Result):
    turns: int
    done: bool
    terminated: bool
    truncated: bool
    total_reward: float | None


class EnvState(Result):
    env_id: str
    config: dict[str, Any]
    started: bool
    rows: list[RowState]
    created_at: float
    updated_at: float


class EnvList(Result):
    envs: list[EnvState]
    total: int
    offset: int
    limit: int


class RolloutResult(Result):
    trajectories: list[Trajectory]
    num_dialog_turns: int
    policy_version: int
    pad_token_id: int | None = None

    def to_tensordict(
        self, *, padded: bool = True, pad_token_id: int | None = None
    ) -> TensorDictBase:
        from rlserve_client.tensordicts import trajectories_to_tensordict

        pad = _pad_id(pad_token_id, self.pad_token_id)
        return trajectories_to_tensordict(self.trajectories, padded=padded, pad_token_id=pad)


class Json(Result):
    """A body without a dedicated model (e.g. `/v1/batching`): its fields as attributes."""
