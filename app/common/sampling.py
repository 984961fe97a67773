"""One sampling vocabulary: every sampling parameter a generation request can ask, in
rlserve's names (`SamplingAsk`). Each route's wire model only renames its fields into an ask
(as vLLM's `to_sampling_params`), with the table of its own names (`Names`) that refusals
use; `ModelServing.sampling` is the one resolver (defaults, the server's limits, the greedy
rule, the vocabulary checks, what the model can do) into the engine's `SamplingConfig`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pydantic import BaseModel

GREEDY_BELOW = 1e-5
"""A temperature below this samples greedily (vLLM's _SAMPLING_EPS: dividing the logits by
less overflows). rlserve's own routes and OpenAI's take 0 or at least 0.01; vLLM's and
SGLang's dialects take any."""
TOP_K_ALL = 1 << 30
"""A top-k this large (SGLang's "every token"), like 0 or -1 (vLLM's), filters nothing."""


@dataclass(frozen=True)
class SamplingAsk:
    """A request's sampling parameters as the caller gave them (unset: the default)."""

    max_new_tokens: int | None = None
    """None: the server's default."""
    temperature: float | None = None
    """None: 1.0; below GREEDY_BELOW: greedy."""
    do_sample: bool | None = None
    """False: greedy, whatever the temperature."""
    top_p: float = 1.0
    top_k: int | None = None
    """None, 0, -1 or TOP_K_ALL: every token."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: Sequence[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: Sequence[int] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | Mapping[str, float] | None = None
    """Keyed by token ids, or their digits (as JSON keys are)."""
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    return_prompt_log_probs: bool = False
    return_routed_experts: bool = False

    @classmethod
    def taken(cls, source: BaseModel, **given: Any) -> SamplingAsk:
        """The ask of a wire model whose declared fields of rlserve's names mean what
        rlserve's do (every vocabulary's do, vLLM's names being rlserve's): those read from
        `source`, the others `given` (renamed, or resolved first, as a stop list). Keys a
        dialect accepts and ignores (its model's extras) are never read."""
        declared = type(source).model_fields
        taken = {
            f.name: getattr(source, f.name)
            for f in fields(cls)
            if f.name not in given and f.name in declared
        }
        return cls(**taken, **given)

    @property
    def greedy(self) -> bool:
        """The greedy rule, the one every route follows."""
        cold = self.temperature is not None and self.temperature < GREEDY_BELOW
        return self.do_sample is False or cold

    @property
    def top_k_or_none(self) -> int | None:
        k = self.top_k
        return k if k is not None and 0 < k < TOP_K_ALL else None


@dataclass(frozen=True)
class Names:
    """A vocabulary's names for rlserve's, as its refusals say them: rlserve's name under
    `prefix` (e.g. "sampling_params."), or the whole name `renamed` gives."""

    prefix: str = ""
    renamed: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, name: str) -> str:
        return self.renamed.get(name, self.prefix + name)


OWN_NAMES = Names()
"""rlserve's own routes: its names, as they are."""
