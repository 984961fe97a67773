"""`TopKCategorical`: the served model's next-token distribution at each position, truncated to
the k most likely tokens the server reported (`top_logprobs`) and renormalized over them.

It is what `RemotePolicy.get_dist` returns: the full distribution would take `vocab_size`
floats per position over HTTP (151k for Qwen-class vocabularies), the top k carry nearly all
of its mass for a peaked policy, and `truncated_mass` says how much was left out at each
position. Quantities of the untruncated distribution that trainers need exactly come from the
server instead: a given token's log-prob (`RemotePolicy.log_prob`, or `raw_log_prob` here when
the token is in the top k) and the entropy (`/v1/logprobs` with `entropy: true`)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch.distributions import Categorical, Distribution, constraints

IGNORE_INDEX = -100  # as TorchRL's LLMMaskedCategorical: a token id that scores 0.0


class TopKCategorical(Distribution):
    """Batch shape `[*B, T]` (one distribution per position), events are token ids.

    `ids` / `raw_log_probs`: `[*B, T, k]`, the k most likely ids at each position and their
    log-probs under the full distribution. `mask`: `[*B, T]`, the positions that count (a
    sequence's first token has no prediction; padding). As TorchRL's LLMMaskedCategorical with
    a position-level mask: `log_prob` is 0.0 at masked positions and for IGNORE_INDEX; here
    `entropy` is 0.0 there too. A token outside the top k has log-prob -inf."""

    arg_constraints: ClassVar[dict[str, constraints.Constraint]] = {}
    has_enumerate_support = False

    def __init__(
        self,
        ids: torch.Tensor,
        raw_log_probs: torch.Tensor,
        mask: torch.Tensor,
        validate_args: bool | None = None,
    ) -> None:
        if ids.shape != raw_log_probs.shape or ids.shape[:-1] != mask.shape:
            raise ValueError(
                "ids and raw_log_probs must be [*B, T, k] and mask [*B, T], got "
                f"{tuple(ids.shape)}, {tuple(raw_log_probs.shape)} and {tuple(mask.shape)}"
            )
        self.ids = ids.long()
        self.mask = mask.bool()
        here = self.mask.unsqueeze(-1)
        # Masked positions hold NaN / -1 on the wire: give them a harmless uniform row.
        self.raw_log_probs = torch.where(here, raw_log_probs, torch.zeros_like(raw_log_probs))
        self.logits = self.raw_log_probs - self.raw_log_probs.logsumexp(-1, keepdim=True)
        self._slots = Categorical(logits=self.logits, validate_args=False)
        super().__init__(batch_shape=self.mask.shape, validate_args=validate_args)

    @property
    def k(self) -> int:
        return int(self.ids.shape[-1])

    @property
    def support(self) -> constraints.Constraint:
        return constraints.nonnegative_integer

    @property
    def probs(self) -> torch.Tensor:
        """`[*B, T, k]`: the renormalized probabilities of `ids`."""
        return self.logits.exp()

    @property
    def truncated_mass(self) -> torch.Tensor:
        """`[*B, T]`: the full distribution's mass outside the top k (0.0 where masked)."""
        kept = self.raw_log_probs.exp().sum(-1)
        return torch.where(self.mask, (1.0 - kept).clamp_min(0.0), torch.zeros_like(kept))

    @property
    def mode(self) -> torch.Tensor:
        return self.ids.gather(-1, self.logits.argmax(-1, keepdim=True)).squeeze(-1)

    def sample(self, sample_shape: torch.Size | list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Token ids `[*sample_shape, *B, T]` drawn from the renormalized top k."""
        slots: torch.Tensor = self._slots.sample(torch.Size(sample_shape))  # type: ignore[no-untyped-call]
        ids = self.ids.expand(*slots.shape, self.k)
        return ids.gather(-1, slots.unsqueeze(-1)).squeeze(-1)

    def _slot_values(self, value: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """`table`'s entry for token `value` at each position (-inf when not in the top k;
        0.0 at masked positions and for IGNORE_INDEX)."""
        value = torch.as_tensor(value, device=self.ids.device).long()
        hit = self.ids == value.unsqueeze(-1)
        found = torch.where(hit, table, torch.full_like(table, -torch.inf)).amax(-1)
        counted = self.mask & (value != IGNORE_INDEX)
        return torch.where(counted, found, torch.zeros_like(found))

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-prob of token ids `value` (`[..., *B, T]`) under the renormalized top k."""
        return self._slot_values(value, self.logits)

    def raw_log_prob(self, value: torch.Tensor) -> torch.Tensor:
        """Log-prob of `value` under the full distribution, where it is in the top k."""
        return self._slot_values(value, self.raw_log_probs)

    def entropy(self) -> torch.Tensor:
        """Entropy of the renormalized top k at each position (0.0 where masked). It is not
        the full distribution's entropy, which the server computes with `entropy: true`."""
        entropy = -(self.probs * self.logits).sum(-1)
        return torch.where(self.mask, entropy, torch.zeros_like(entropy))

    def expand(self, batch_shape: Any, _instance: Any = None) -> TopKCategorical:
        shape = torch.Size(batch_shape)
        return TopKCategorical(
            self.ids.expand(*shape, self.k),
            self.raw_log_probs.expand(*shape, self.k),
            self.mask.expand(shape),
        )
