"""One generation vocabulary: every sampling parameter a generation request can ask, in
rlserve's names (`SamplingAsk`, which lives in `rlserve_client.sampling`: the client speaks the
same vocabulary), and what it asks to be scored along (`GenerationAsk`). Each route's wire
model only renames its fields into an ask (as vLLM's `to_sampling_params`), with the table of
its own names (`Names`) that refusals use; `ModelServing.resolve` is the one resolver
(defaults, the server's limits, the greedy rule, the vocabulary checks, what the model can
do) into the engine's `SamplingConfig` and score requests together. Nothing maps after it (a
test holds the routes to that)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlserve_client.sampling import GREEDY_BELOW, TOP_K_ALL, SamplingAsk

__all__ = ["GREEDY_BELOW", "OWN_NAMES", "TOP_K_ALL", "GenerationAsk", "Names", "SamplingAsk"]


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


@dataclass(frozen=True)
class GenerationAsk:
    """Everything a generation asks, in rlserve's names: how to sample (`sampling`), what is
    scored along each generated token and each prompt, which routing comes back, and whether
    rows run batch-invariant. Every field's default asks nothing."""

    sampling: SamplingAsk = field(default_factory=SamplingAsk)
    top_logprobs: int = 0
    """The k most likely tokens at each generated position (0: none)."""
    ranks: bool = False
    """Each chosen token's rank too (vLLM's logprobs, which ask it even for k = 0)."""
    entropy: bool = False
    """The entropy of the whole distribution at each generated position."""
    prompt_top_logprobs: int | None = None
    """Score each prompt: its tokens' log-probs and ranks, and the k most likely (vLLM's
    prompt_logprobs; None: not scored)."""
    routing_where_recorded: bool = False
    """Return the routing where the model records one, and nothing where it does not
    (vLLM's --enable-return-routed-experts); `sampling.return_routed_experts` instead
    refuses a model without routers."""
    routing_start: int = 0
    """With `routing_where_recorded`: the first prompt position returned (within every
    prompt)."""
    batch_invariant: bool | None = None
    """Each row in a model call of its own (None: the server's `batching.invariant`)."""
