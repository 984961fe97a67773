"""Wire models of `/v1/rewards`: sequences to score with the reward model, in the inputs
`/v1/logprobs` takes, and a reward per row."""

from __future__ import annotations

from pydantic import Field

from app.common.protocol import ServerPath, SplitInputFields, Version, WireModel


class RewardsRequest(SplitInputFields):
    """Conversations (templated with the reward model's own chat template), texts or token ids
    (the reward model's vocabulary), or prompt/response splits: one reward per sequence."""

    model: str = Field(
        default="reward",
        min_length=1,
        max_length=4096,
        description="'reward', or the reward model's source as the server was started with it "
        "(--reward-model), as verl's reward loop names it.",
    )
    token_values: bool = Field(
        default=False,
        description="Also the head's output at every token of each sequence (what a process "
        "reward model reads per step).",
    )


class Reward(WireModel):
    reward: float = Field(description="The head's output at the sequence's last token.")
    rewards: list[float] | None = Field(
        default=None,
        description="Every label's output at the last token, for a head of several labels "
        "(`reward` is the first).",
    )
    token_values: list[float] | list[list[float]] | None = Field(
        default=None,
        description="With token_values: the head's output at every token (one value per "
        "token; a list of labels' values per token for a head of several).",
    )
    num_tokens: int = Field(description="The sequence's length in the reward model's tokens.")
    token_ids: list[int] | None = Field(
        default=None,
        description="The tokens scored, when the request gave messages or text (templated and "
        "tokenized by the reward model's tokenizer).",
    )


class RewardsResponse(WireModel):
    model: str
    reward_version: int = Field(description="The version of the reward model's weights.")
    outputs: list[Reward]


class LoadRewardWeightsRequest(WireModel):
    path: ServerPath = Field(
        description="A safetensors checkpoint directory (HF layout) or file the server can "
        "read: any subset of the reward model's parameters, each its name, shape and dtype."
    )
    version: Version | None = Field(
        default=None,
        description="The version this load publishes: above the current one (409 otherwise), "
        "at most 2^53 - 1. Default: the current one plus one.",
    )


class RewardWeightsLoaded(WireModel):
    reward_version: int
    num_tensors: int
    num_bytes: int
    seconds: float = Field(
        description="The swap's time: the longest a reward model's call waited for it."
    )
    total_seconds: float = Field(description="Time the whole load took.")
    digest: str | None = Field(
        default=None, description="The digest of the reward model's weights after the load."
    )
