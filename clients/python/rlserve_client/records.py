"""The sequence records every result is made of, in TorchRL's containers (text / tokens /
masks / log_probs / history, each with prompt / response / full): one generated or scored
`Sample`, an environment's `Step` and `Trajectory`. `types` builds the route results from
them and `tensordicts` converts them (each imports this module, neither the other)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "History",
    "LogProbs",
    "Masks",
    "Message",
    "Result",
    "Sample",
    "Step",
    "Text",
    "Tokens",
    "TopLogProbs",
    "Trajectory",
    "VersionSpan",
]


class Result(BaseModel):
    model_config = ConfigDict(extra="allow")


class Message(Result):
    role: str
    content: str


class Text(Result):
    prompt: str | None = None
    response: str | None = None
    full: str | None = None


class Tokens(Result):
    prompt: list[int] | None = None
    response: list[int] | None = None
    full: list[int] | None = None


class LogProbs(Result):
    prompt: list[float] | None = None
    response: list[float] | None = Field(
        default=None,
        description="Log-probs of the response tokens under the raw model distribution "
        "(temperature 1, no top-k/top-p/penalty): what a trainer's own forward computes.",
    )
    response_processed: list[float] | None = Field(
        default=None,
        description="Generation only: log-probs of the sampled tokens under the distribution "
        "actually sampled from (after repetition penalty, temperature, top-k and top-p).",
    )
    full: list[float] | None = Field(
        default=None,
        description="log p(x_t | x_<t) for every token of tokens.full; position 0 is 0.0.",
    )


class Masks(Result):
    all_attention_mask: list[int] | None = None
    all_assistant_mask: list[int] | None = Field(
        default=None,
        description="1 on tokens written by the assistant (content and end-of-turn token).",
    )


class History(Result):
    prompt: list[Message] | None = None
    response: list[Message] | None = None
    full: list[Message] | None = None


class VersionSpan(Result):
    """Response tokens [start, end) were sampled by weights of policy version `version`."""

    version: int
    start: int = Field(description="First response token (index into tokens.response).")
    end: int = Field(description="One past the last response token.")


class TopLogProbs(Result):
    ids: list[list[int] | None]
    log_probs: list[list[float] | None]


class Sample(Result):
    """One generated or scored sequence: what a trainer reads first (tokens, masks,
    log-probs), then the text and chat forms of the same sequence."""

    tokens: Tokens
    masks: Masks
    log_probs: LogProbs | None = None
    text: Text | None = None
    history: History | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: str | int | None = None
    """The stop string, or the token of stop_token_ids, that ended generation."""
    policy_versions: list[VersionSpan] | None = None
    top_logprobs: TopLogProbs | None = None
    """Scored: one row per token of the span; generated: one per response token (asked for)."""
    entropy: list[float | None] | None = None
    routed_experts: Any = None
    """Generated, when asked (mixture-of-experts models): per token of `tokens.full` but the
    last, `[num_layers][top_k]` expert ids (a tensor with `tensors=True`)."""

    def token_versions(self) -> list[int] | None:
        """The policy version of each response token (None when the server did not say)."""
        if self.policy_versions is None:
            return None
        return [span.version for span in self.policy_versions for _ in range(span.start, span.end)]


class Step(Sample):
    """One dialog turn: the observation's tokens as `tokens.prompt`, the generated reply as
    `tokens.response`, its raw log-probs, the env's reward and flags, and the policy version
    that generated it."""

    reward: float | None
    """None when a judge gave no score (see `StepOutput.reward`)."""
    done: bool
    terminated: bool
    truncated: bool
    policy_version: int
    info: dict[str, Any] = {}
    advantage: float | None = None


class Trajectory(Result):
    """One episode. `advantage` and `group` are set for GRPO groups (repeats > 1)."""

    env_id: str
    row: int
    steps: list[Step]
    reward: float | None
    """The steps' rewards summed; None when a step has none (no advantage then)."""
    group: int | None = None
    advantage: float | None = None
    history: list[Message] | None = None
