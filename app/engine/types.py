"""Plain data passed between the services and the backends (no pydantic, no HTTP)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch

    from app.engine.abandon import Abandonment
    from app.weights.lora import LoraAdapter

FinishReason = Literal["stop", "length", "abort"]
MAX_VERSION = (1 << 53) - 1
"""The largest weight version: every trainer can count to it (a JSON number holds it exactly in
any language, JavaScript's included), and no run of updates reaches it."""


@dataclass(frozen=True)
class SamplingConfig:
    """Resolved generation parameters of one row (aliases already applied)."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_sequences: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_prompt_log_probs: bool = False
    return_routed_experts: bool = False
    """Record the experts each MoE layer routed the row's tokens to (`Generation.
    routed_experts`)."""
    min_tokens: int = 0
    """End-of-sequence and `stop_token_ids` are masked, and stops not checked, until this many
    tokens are generated."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation stops after any of these (the row's `stop_reason` is the id)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """OpenAI's penalties over the generated tokens: minus `presence` once a token appeared,
    minus `frequency` times how often."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) added to the logits before the penalties (as vLLM does)."""
    allowed_token_ids: tuple[int, ...] | None = None
    """Only these tokens can be sampled."""
    bad_words: tuple[str, ...] = ()
    """Words never to generate (as given: vLLM tokenizes them itself)."""
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    """`bad_words` as token sequences (each with and without a leading space, as vLLM's
    `SamplingParams.update_from_tokenizer` cuts them): the last token of one is masked when the
    generated tokens end with the rest of it."""

    @property
    def constrained(self) -> bool:
        """Whether anything beyond temperature/top-k/top-p/min-p/repetition shapes the logits."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
            or self.allowed_token_ids is not None
            or self.bad_word_ids
        )

    @classmethod
    def resolve(
        cls,
        max_new_tokens: int,
        *,
        greedy: bool,
        temperature: float | None,
        stops: list[str] | None = None,
        top_p: float = 1.0,
        top_k: int | None = None,
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        ignore_eos: bool = False,
        return_prompt_log_probs: bool = False,
        return_routed_experts: bool = False,
        **constraints: Any,
    ) -> SamplingConfig:
        """The request rule, in one place: greedy rows score at temperature 1 without top-k
        or top-p (as vLLM treats them); otherwise the temperature defaults to 1. The
        `constraints` (min_tokens, stop_token_ids, penalties, logit_bias, allowed_token_ids,
        bad words) apply to greedy rows too, before the argmax, as in vLLM."""
        return cls(
            max_new_tokens=max_new_tokens,
            do_sample=not greedy,
            temperature=1.0 if greedy or temperature is None else temperature,
            top_p=1.0 if greedy else top_p,
            top_k=None if greedy else top_k,
            min_p=0.0 if greedy else min_p,
            repetition_penalty=repetition_penalty,
            stop_sequences=tuple(stops or ()),
            ignore_eos=ignore_eos,
            return_prompt_log_probs=return_prompt_log_probs,
            return_routed_experts=return_routed_experts,
            **constraints,
        )


@dataclass(frozen=True)
class GenerateItem:
    """One row to generate: a prompt, its parameters and the seed of its random stream."""

    prompt_ids: tuple[int, ...]
    config: SamplingConfig
    seed: int
    abandoned: Abandonment | None = field(default=None, compare=False)
    """Set when the requester is gone: decoding stops at the next token (app.engine.abandon)."""
    sink: TokenSink | None = field(default=None, compare=False)
    """Told each token as it is sampled (streaming), from whatever thread samples it."""
    prompt_asks: ScoreSpec | None = None
    """Score the prompt for these (its log-probs, top-k, ranks: `ScoreSpec.ranked_top_k`) in
    the generation's own pass: only for engines with `Capabilities.prompt_scores`."""
    adapter: LoraAdapter | None = None
    """Generate with this LoRA adapter on the model (None: the model itself)."""
    reuse_prefix: bool = True
    """Whether the engine may take the prompt's leading keys and values from its prefix
    cache (False in batch-invariant mode: a row's values then come from its own prefill)."""


@dataclass(frozen=True)
class PrefixCacheStats:
    """An engine's prefix cache (`Backend.prefix_cache`): its hit rate and memory."""

    queried_tokens: int
    """Prompt tokens looked up."""
    hit_tokens: int
    """Of those, tokens whose keys and values came from the cache (not prefilled)."""
    entries: int
    bytes: int
    max_bytes: int


class TokenSink(Protocol):
    def put(self, token_ids: list[int], log_probs: list[float]) -> None:
        """New tokens of the row and the log-probs the engine sampled them with (raw, or
        processed where the engine reports only those). Thread-safe, never blocks."""


@dataclass(frozen=True)
class VersionSpan:
    """Generated tokens [start, end) were sampled from weights of policy version `version`."""

    version: int
    start: int
    end: int


def version_spans(per_token: list[int]) -> list[VersionSpan]:
    spans: list[VersionSpan] = []
    for i, version in enumerate(per_token):
        if spans and spans[-1].version == version:
            spans[-1] = VersionSpan(version, spans[-1].start, i + 1)
        else:
            spans.append(VersionSpan(version, i, i + 1))
    return spans


@dataclass
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    processed_log_probs: list[float] | None
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    """The stop string or stop token id that ended the row (None at end-of-sequence)."""
    prompt_log_probs: list[float] | None = None
    versions: list[VersionSpan] | None = None
    """Which weights produced which tokens; None when the engine does not say."""
    prompt_scores: Scores | None = None
    """The prompt scored for the item's `prompt_asks` (None when not asked, or aborted)."""
    routed_experts: torch.Tensor | None = None
    """`[len(prompt) + len(token_ids) - 1, num_layers, top_k]` int64: the experts each MoE layer
    routed each fed token to (`rlserve_client.moe`'s layout), when the config asked."""


@dataclass(frozen=True)
class ModelInfo:
    """A loaded model, as its backend describes it (`/v1/models` shows it as a card): what it
    is, how large, where it runs."""

    name: str
    """'policy', 'reference', 'judge' or 'reward'."""
    source: str
    """Where its weights came from: a folder, a hub id, a built-in model's cache."""
    backend: str
    max_model_len: int
    """The longest sequence it serves (prompt and generation together)."""
    vocab_size: int
    dtype: str
    """The dtype it computes in."""
    device: str
    builtin: bool = False
    extra: dict[str, str] = field(default_factory=dict)
    """Backend-specific facts, for logs."""

    def summary(self) -> str:
        """One line for logs: `policy: /path (transformers, float32 on cpu, 8192 tokens)`."""
        return (
            f"{self.name}: {self.source} ({self.backend}, {self.dtype} on {self.device}, "
            f"{self.max_model_len} tokens)"
        )


@dataclass(frozen=True)
class ScoreSpec:
    """A scoring call's asks beyond the raw log-prob of each token. The extras cover the
    positions from `start` on (position p: the prediction of token p from tokens < p)."""

    top_logprobs: int = 0
    entropy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    token_ids: tuple[int, ...] | None = None
    ranks: bool = False
    """Each token's rank in the raw distribution (1: the most likely), as vLLM reports it."""
    start: int = 1
    adapter: LoraAdapter | None = None
    """Score with this LoRA adapter on the model (None: the model itself)."""
    routed_experts: torch.Tensor | None = field(default=None, compare=False)
    """Replay this routing (`[positions, num_layers, top_k]` int64 from position 0, -1 where
    the router chooses) instead of the MoE routers' own choices."""

    @property
    def processed(self) -> bool:
        """Log-probs under the temperature-scaled, top-k/top-p truncated distribution."""
        return self.temperature != 1.0 or bool(self.top_k) or self.top_p < 1.0

    @property
    def needs_full_distribution(self) -> bool:
        """Whether the whole vocabulary is needed (top-k alone is not: engines return it)."""
        return not self.ranked_top_k or self.ranks

    @property
    def ranked_top_k(self) -> bool:
        """Whether an engine's own top-k and ranks answer it (vLLM's prompt log-probs)."""
        return not (self.entropy or self.processed or self.token_ids is not None)

    @property
    def extras(self) -> bool:
        return self.top_logprobs > 0 or self.needs_full_distribution


@dataclass
class Scores:
    """One sequence's answers. `log_probs` covers every position (0.0 at position 0); the
    extras cover positions `start`… (one row per position), None when not asked."""

    log_probs: torch.Tensor
    start: int = 1
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    processed: torch.Tensor | None = None
    """-inf where top-k/top-p removed the token."""
    truncated_mass: torch.Tensor | None = None
    """Probability mass (of the temperature-scaled distribution) that top-k/top-p removed."""
    candidates: torch.Tensor | None = None
    """[positions, len(token_ids)] log-probs of the requested ids."""
    ranks: torch.Tensor | None = None
    """Each token's rank: 1 + how many tokens the raw distribution finds more likely."""
