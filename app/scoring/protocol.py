"""Wire models of `POST /v1/logprobs`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.common.containers import Sample
from app.common.protocol import RoutedExperts, ServedName, SplitInputFields, TopK, WireModel

Span = Literal["response", "full"]


class LogProbsRequest(SplitInputFields):
    """Sequences to score: messages, text or tokens, or a prompt/response split. Beyond the
    raw log-prob of every token, a request may ask for more about the next-token distribution
    at each position of its span; nothing it does not ask for is computed."""

    model: ServedName = "policy"
    top_logprobs: int = Field(
        default=0,
        ge=0,
        description="The k most likely tokens and their raw log-probs at every position of "
        "the span (the server's cap: max_top_logprobs, 64 by default).",
    )
    entropy: bool = Field(
        default=False, description="Per-position entropy (nats) of the raw distribution."
    )
    batch_invariant: bool | None = Field(
        default=None,
        description="Each sequence scored in a model call of its own: bitwise the same "
        "whatever else is sent. Default: the server's batching.invariant. transformers "
        "backend only.",
    )
    temperature: float = Field(
        default=1.0,
        gt=0,
        le=1e4,
        description="With top_k/top_p: also return log-probs of the tokens under the "
        "processed distribution (logits / temperature, then top-k, then top-p), as sampling "
        "at these settings would see them, and the probability mass the truncation removed.",
    )
    top_k: TopK = None
    top_p: float = Field(default=1.0, gt=0, le=1)
    token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = Field(
        default=None,
        description="Candidate ids: their raw log-probs at every position of the span "
        "(fixed-vocabulary scoring; the server's cap: max_candidate_ids).",
    )
    routed_experts: list[RoutedExperts | None] | None = Field(
        default=None,
        description="Mixture-of-experts models: per input, the routing to replay (what "
        "generation returned as routed_experts: per token from the first, "
        "[num_hidden_layers][num_experts_per_tok] expert ids; a sequence of T tokens takes "
        "T - 1 or T of them), so each MoE layer uses these experts, weighted by its router's "
        "probabilities for them, instead of choosing its own; null: the router chooses. "
        "transformers backend only.",
    )
    reference_log_probs: list[list[float]] | None = Field(
        default=None,
        description="Per input, log-probs of the span's tokens from elsewhere (e.g. what "
        "generation returned): each output gets a mismatch report against them.",
    )
    mismatch_threshold: float = Field(
        default=0.1,
        gt=0,
        description="A token whose |difference| exceeds this counts in num_beyond_threshold.",
    )
    span: Span | None = Field(
        default=None,
        description="Which tokens the extras cover: the response (the default when the input "
        "is split into prompt and response) or the full sequence (the default otherwise).",
    )


class TopLogProbs(WireModel):
    ids: list[list[int] | None] = Field(
        description="Per position of the span, the k most likely ids (most likely first); "
        "null where nothing is predicted (the first token of a sequence)."
    )
    log_probs: list[list[float] | None]


class ProcessedLogProbs(WireModel):
    log_probs: list[float | None] = Field(
        description="Per position of the span, the token's log-prob under the processed "
        "distribution; null where top-k/top-p removed it (probability 0) or nothing is "
        "predicted."
    )
    truncated_mass: list[float | None] = Field(
        description="The probability mass top-k/top-p removed at each position."
    )


class MismatchReport(WireModel):
    """These log-probs against the given reference, over the span's predicted tokens."""

    difference: list[float | None] = Field(
        description="Per token of the span: these log-probs minus the reference's."
    )
    max_abs: float
    mean_abs: float
    effective_sample_size: float = Field(
        description="Of the importance ratios w = exp(difference): (Σw)² / Σw², out of "
        "num_tokens (equal log-probs give num_tokens)."
    )
    num_tokens: int
    num_beyond_threshold: int
    threshold: float


class ScoredSample(Sample):
    span: Span | None = Field(default=None, description="What the extras below cover.")
    top_logprobs: TopLogProbs | None = None
    entropy: list[float | None] | None = None
    processed: ProcessedLogProbs | None = None
    token_id_log_probs: list[list[float] | None] | None = Field(
        default=None, description="Per position of the span, the log-prob of each token_ids."
    )
    mismatch: MismatchReport | None = None


class LogProbsResponse(WireModel):
    policy_version: int
    model: ServedName
    pad_token_id: int = Field(description="The model's padding token (for padded layouts).")
    outputs: list[ScoredSample]
