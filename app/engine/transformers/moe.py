"""Routed experts in the transformers backend's model calls: a scoring call's rows replayed as
their specs say, and a generation's routing recorded per row (`rlserve_client.moe` holds the
hooks and the layout)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from app.engine.types import GenerateItem, ScoreSpec

if TYPE_CHECKING:
    from rlserve_client.moe import Recorded, Routing


def replayed(
    routing: Routing | None, specs: Sequence[ScoreSpec], width: int
) -> contextlib.AbstractContextManager[None]:
    """Forwards in this block (over the rows of `specs`, right-padded to `width`) route as the
    specs' `routed_experts` say, each row from position 0; the routers choose elsewhere."""
    given = [spec.routed_experts for spec in specs]
    if all(g is None for g in given):
        return contextlib.nullcontext()
    if routing is None:
        raise ValueError("a row gives routed experts, but this model has no MoE routers")
    from rlserve_client.moe import as_batch

    empty = torch.empty((0, routing.num_layers, routing.top_k), dtype=torch.long)
    rows = [empty if g is None else g for g in given]
    experts = as_batch(rows, (len(specs), width))
    return routing.replaying(experts.reshape(-1, routing.num_layers, routing.top_k))


def recording(routing: Routing | None, items: Sequence[GenerateItem]) -> Any:
    """A recording of the forwards in this block, when a row asks for its routed experts."""
    if routing is None or not any(it.config.return_routed_experts for it in items):
        return contextlib.nullcontext(None)
    return routing.recording()


class RoutedRows:
    """The routing a generation's forwards recorded (nothing without a recording): the
    prefill's, `[rows, prompt width, layers, top_k]`, and one `[rows, layers, top_k]` per
    token fed after it."""

    def __init__(self, recorded: Recorded | None) -> None:
        self.recorded = recorded
        self.prompt: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def prefilled(self, num_rows: int, expand: torch.Tensor | None) -> None:
        if self.recorded is None:
            return
        taken = self.recorded.take()
        prompt = taken.view(num_rows, -1, *taken.shape[1:])
        self.prompt = prompt if expand is None else prompt.index_select(0, expand.cpu())

    def stepped(self, num_rows: int, *, rebuilt: bool) -> None:
        """After a decoding forward. `rebuilt`: a weight change rebuilt the cache, and the
        forward fed every token again; the tokens fed before keep the routing they had (the
        routing the tokens after them were sampled with: one rule with the returned
        log-probs, which are the weights' that sampled each token), and only the newest
        token's routing is taken from it."""
        if self.recorded is None:
            return
        taken = self.recorded.take()
        if rebuilt:
            taken = taken.view(num_rows, -1, *taken.shape[1:])[:, -1]
        self.steps.append(taken)

    def of(self, row: int, num_prompt: int, num_generated: int) -> torch.Tensor | None:
        """Row `row`'s routing: its prompt's and its fed tokens' (all but the last)."""
        if self.prompt is None:
            return None
        width = self.prompt.shape[1]
        parts = [self.prompt[row, width - num_prompt :]]
        parts += [step[row : row + 1] for step in self.steps[: max(num_generated - 1, 0)]]
        return torch.cat(parts)[: num_prompt + num_generated - 1].clone()
