"""One sampling vocabulary: every sampling parameter a generation request can ask, in
rlserve's names (`SamplingAsk`, which lives in `rlserve_client.sampling`: the client speaks the
same vocabulary). Each route's wire model only renames its fields into an ask
(as vLLM's `to_sampling_params`), with the table of its own names (`Names`) that refusals
use; `ModelServing.sampling` is the one resolver (defaults, the server's limits, the greedy
rule, the vocabulary checks, what the model can do) into the engine's `SamplingConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rlserve_client.sampling import GREEDY_BELOW, TOP_K_ALL, SamplingAsk

__all__ = ["GREEDY_BELOW", "OWN_NAMES", "TOP_K_ALL", "Names", "SamplingAsk"]


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
