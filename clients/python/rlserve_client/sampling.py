"""The generation vocabulary, one for the server and the client: every sampling parameter a
generation can ask (`SamplingAsk`, in rlserve's names; the server renames every route's
fields into it) and every parameter `POST /v1/generate` takes besides its inputs
(`GENERATION_PARAMETERS`). The client's raw `generate`, its collectors' `generation` and
`RemotePolicy`'s `generate_kwargs` take exactly these (`check_generation_parameters`); a test
holds the server's wire model to the same set."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import BaseModel

__all__ = [
    "ALIASES",
    "GENERATION_PARAMETERS",
    "GREEDY_BELOW",
    "SAMPLING_PARAMETERS",
    "TOP_K_ALL",
    "WISHES",
    "SamplingAsk",
    "check_generation_parameters",
]

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


SAMPLING_PARAMETERS: tuple[str, ...] = tuple(f.name for f in fields(SamplingAsk))
"""The sampling parameters, as `POST /v1/generate` names them."""
ALIASES: Mapping[str, str] = {
    "max_tokens": "max_new_tokens",
    "stop_sequences": "stop",
    "n": "num_return_sequences",
    "logprobs": "return_log_probs",
}
"""Other names `POST /v1/generate` takes for a parameter (vLLM's and TorchRL's): the alias
wins when both are given."""
WISHES: tuple[str, ...] = (
    "num_return_sequences",
    "seed",
    "skip_special_tokens",
    "return_log_probs",
    "top_logprobs",
    "entropy",
    "batch_invariant",
)
"""What a generation asks besides sampling: how many samples, their random streams, the text
returned, and what is scored along (log-probs, the top tokens, entropy) and how (each row in
a model call of its own)."""
GENERATION_PARAMETERS: frozenset[str] = frozenset((*SAMPLING_PARAMETERS, *ALIASES, *WISHES))
"""Every parameter `POST /v1/generate` takes besides its inputs and `model`."""


def check_generation_parameters(names: Iterable[str], where: str) -> None:
    """Raise ValueError naming the parameters (of `where`) the server does not take."""
    unknown = sorted(set(names) - GENERATION_PARAMETERS)
    if unknown:
        raise ValueError(
            f"{where}: {unknown} not taken by the server's POST /v1/generate (it takes: "
            f"{sorted(GENERATION_PARAMETERS)})"
        )
