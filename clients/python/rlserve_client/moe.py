"""Routed experts of a mixture-of-experts model: which experts each MoE layer's router chose for
each token, recorded from one forward and replayed in another ("routing replay", R3).

A sampler and a trainer that batch the same tokens differently can route them to different
experts (a near tie in the router flips with the order of a float sum, far more in bfloat16),
and the trainer's log-probs then come from another computation than the sampler's. Replaying
the sampler's routing makes the trainer's forward use the same experts, with the router's own
weights for them.

The layout everywhere (rlserve's routes, vLLM's and SGLang's, this module): per token,
`[num_layers, top_k]` expert ids, one row per hidden layer (a dense layer's row is zeros and is
never replayed), each row in the router's order (highest weight first). A sequence of `T`
tokens has `T - 1` rows: token `t`'s routing when it was fed to predict token `t + 1` (the last
token is never fed).

For a trainer, one call around its own transformers forward::

    with replay_experts(model, routed_experts):   # [batch, positions, layers, top_k]
        logits = model(input_ids).logits

`Routing` is the machinery behind it, which the rlserve server uses too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NOT_GIVEN = -1
"""An expert id that replay leaves to the router (padding, positions with no given routing)."""


@dataclass(frozen=True)
class _Rule:
    """How a router family turns its logits into the weights of its chosen experts."""

    normalize: bool | str
    """Renormalise the chosen experts' probabilities to sum to one: always (True), never
    (False), or as the router's attribute of this name says."""


# transformers' top-k routers (5.x): `forward(hidden [N, H]) -> (logits, weights, indices)`,
# weights = softmax(logits in float32) at the top-k indices, renormalised where the family does.
_RULES: dict[str, _Rule] = {
    "Qwen3MoeTopKRouter": _Rule(normalize="norm_topk_prob"),
    "Qwen2MoeTopKRouter": _Rule(normalize="norm_topk_prob"),
    "OlmoeTopKRouter": _Rule(normalize="norm_topk_prob"),
    "MixtralTopKRouter": _Rule(normalize=True),
}
SUPPORTED = tuple(sorted(_RULES))


class UnsupportedRouting(ValueError):
    """A model whose routers this module cannot record or replay (or that has none)."""


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module | None]:
    """Per hidden layer of `model` (a transformers causal LM or its decoder), its MoE router,
    or None for a dense layer; empty for a model with no router of a supported family."""
    get_decoder: Any = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        return []
    found: list[torch.nn.Module | None] = []
    for layer in layers:
        routers = [m for m in layer.modules() if type(m).__name__ in _RULES]
        found.append(routers[0] if routers else None)
    return found if any(r is not None for r in found) else []


class Routing:
    """A model's routers, hooked once. Forwards inside `recording()` have their routing
    recorded; forwards inside `replaying(experts)` route as `experts` says. Neither context
    open: the hooks do nothing. Not thread-safe: one forward at a time (as a model is)."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = find_routers(model)
        if not routers:
            raise UnsupportedRouting(
                f"{type(model).__name__} has no mixture-of-experts router rlserve can record "
                f"or replay (supported: {', '.join(SUPPORTED)})"
            )
        first: Any = next(r for r in routers if r is not None)
        self.num_layers = len(routers)
        self.top_k = int(first.top_k)
        self.num_experts = int(first.num_experts)
        self.moe_layers = [i for i, r in enumerate(routers) if r is not None]
        self._recorded: dict[int, list[torch.Tensor]] | None = None
        self._replay: torch.Tensor | None = None
        self._handles = [
            router.register_forward_hook(self._hook(layer, router))
            for layer, router in enumerate(routers)
            if router is not None
        ]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Routing | None:
        """`model`'s routers hooked, or None for a model without supported routers."""
        try:
            return cls(model)
        except UnsupportedRouting:
            return None

    def close(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorded]:
        """Record the routing of the forwards in this block (`Recorded.take` after each)."""
        recorded = Recorded(self)
        self._recorded = recorded.layers
        try:
            yield recorded
        finally:
            self._recorded = None

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor | None) -> Iterator[None]:
        """Route the forwards in this block as `experts` says: `[num_tokens, num_layers,
        top_k]`, one row per token the forward flattens its batch to (row-major over batch and
        position), NOT_GIVEN where the router chooses itself. None: replay nothing."""
        if experts is None:
            yield
            return
        self.route_as(experts)
        try:
            yield
        finally:
            self._replay = None

    def route_as(self, experts: torch.Tensor) -> None:
        """Route the next forwards as `experts` says (checked; see `replaying`)."""
        self.check(experts, "routed_experts")
        self._replay = experts

    def check(self, experts: torch.Tensor, name: str) -> None:
        """Raise ValueError (naming `name`) unless `experts` fits this model's routers."""
        if experts.dim() < 2 or tuple(experts.shape[-2:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"{name}: each token needs {self.num_layers} layers x {self.top_k} experts "
                f"(this model's num_hidden_layers and num_experts_per_tok), got shape "
                f"{list(experts.shape)}"
            )
        given = experts[..., self.moe_layers, :]
        outside = (given >= self.num_experts) | (given < NOT_GIVEN)
        if bool(outside.any()):
            bad = int(given[outside][0])
            raise ValueError(
                f"{name}: expert id {bad} is outside [0, {self.num_experts}) (this model's "
                "num_experts)"
            )

    def _hook(self, layer: int, router: torch.nn.Module) -> Any:
        rule = _RULES[type(router).__name__]
        normalize = rule.normalize
        if isinstance(normalize, str):
            normalize = bool(getattr(router, normalize, False))

        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            logits, weights, indices = output
            if self._replay is not None:
                given = self._replay[:, layer].to(indices.device)
                if given.shape[0] != indices.shape[0]:
                    raise ValueError(
                        f"routed_experts: {given.shape[0]} tokens given for a forward of "
                        f"{indices.shape[0]}"
                    )
                mine = given[:, 0] == NOT_GIVEN
                if not bool(mine.all()):
                    indices = torch.where(mine[:, None], indices, given)
                    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
                    chosen = probs.gather(-1, indices)
                    if normalize:
                        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
                    weights = chosen.to(weights.dtype)
            if self._recorded is not None:
                self._recorded[layer].append(indices.detach())
            return logits, weights, indices

        return hook


class Recorded:
    """The routing recorded in a `Routing.recording()` block, one forward at a time."""

    def __init__(self, routing: Routing) -> None:
        self.routing = routing
        self.layers: dict[int, list[torch.Tensor]] = {i: [] for i in routing.moe_layers}

    def take(self) -> torch.Tensor:
        """The last forward's routing: `[num_tokens, num_layers, top_k]` int64 on the CPU
        (row-major over the forward's batch and positions; zeros at dense layers)."""
        parts = {layer: calls[-1] for layer, calls in self.layers.items()}
        first = next(iter(parts.values()))
        out = torch.zeros(
            (first.shape[0], self.routing.num_layers, self.routing.top_k), dtype=torch.long
        )
        for layer, indices in parts.items():
            out[:, layer] = indices.cpu()
            self.layers[layer].clear()
        return out


def as_batch(
    routed_experts: torch.Tensor | Sequence[Any],
    shape: tuple[int, int],
    starts: Sequence[int] | None = None,
    per_token: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Routed experts laid out for a batch of `shape` (batch, positions): from a tensor
    `[batch, rows, layers, top_k]` (or `[rows, layers, top_k]` for a batch of one) or a list of
    per-sequence rows (tensors, arrays or nested lists, as rlserve, vLLM or SGLang give them).
    With `per_token` (layers, top_k), a sequence's rows may also come flat (AReaL's
    `[rows, layers * top_k]`, SGLang's decoded int32 bytes). Sequence i's rows start at
    position `starts[i]` (default 0); every other position is NOT_GIVEN."""
    batch, width = shape
    if isinstance(routed_experts, torch.Tensor):
        given = routed_experts.unsqueeze(0) if routed_experts.dim() == 3 else routed_experts
        rows = list(given)
    else:
        rows = [torch.as_tensor(r).to(torch.long) for r in routed_experts]
    if len(rows) != batch:
        raise ValueError(f"routed_experts: {len(rows)} sequences for a batch of {batch}")
    trailing = per_token or next((tuple(r.shape[1:]) for r in rows if r.dim() == 3), None)
    if trailing is None:
        raise ValueError("routed_experts: each sequence needs [positions, layers, top_k]")
    out = torch.full((batch, width, *trailing), NOT_GIVEN, dtype=torch.long)
    for i, row in enumerate(rows):
        start = 0 if starts is None else int(starts[i])
        row = row.to(torch.long).reshape(-1, *trailing)[: width - start]
        out[i, start : start + len(row)] = row
    return out


@contextlib.contextmanager
def replay_experts(
    model: torch.nn.Module, routed_experts: torch.Tensor | Sequence[Any]
) -> Iterator[None]:
    """Run the forwards of `model` (a transformers MoE causal LM) in this block with the given
    routing. `routed_experts`: per sequence of the batch, `[rows, num_layers, top_k]` as
    rlserve (or vLLM, SGLang) returned it, a tensor, an array or a list, or its rows flat
    (`[rows, num_layers * top_k]`, as AReaL keeps them). A sequence's rows start at its
    first token (the first position its `attention_mask` keeps, for left-padded batches);
    positions past its rows (the last token of a sampler's `T - 1` rows, padding) are left to
    the router.

    Each forward in the block is laid out this way from its own input_ids: for forwards over
    whole sequences (a trainer's), not a generation loop with a cache."""
    routing = Routing(model)

    def start(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("replay_experts needs forwards given input_ids")
        mask = kwargs.get("attention_mask")
        starts = None
        if mask is not None and mask.dim() == 2:
            starts = mask.ne(0).int().argmax(dim=1).tolist()
        per_token = (routing.num_layers, routing.top_k)
        batch = as_batch(routed_experts, (ids.shape[0], ids.shape[1]), starts, per_token)
        routing.route_as(batch.reshape(-1, routing.num_layers, routing.top_k))

    handle = model.register_forward_pre_hook(start, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
        routing.close()
