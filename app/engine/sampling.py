"""Per-row logits processing and sampling, so rows with different parameters share a batch.

Order follows vLLM: repetition penalty, temperature, min-p, then top-k and top-p."""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence

import torch

from app.engine.types import SamplingConfig


def row_seed(seed: int | None, index: int) -> int:
    """Independent stream per returned sequence: a hash of (request seed, sample index)."""
    if seed is None:
        return secrets.randbits(63)
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def filter_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Logits [B, V] with each row's top-k (0: off) then top-p filter applied ([B, 1] each):
    removed entries are -inf. Top-p keeps the most likely tokens until the mass before the
    next one exceeds p (the most likely token always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before > top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] without the tokens less likely than min_p [B, 1] times the most likely
    one (0: off): removed entries are -inf."""
    log_ratio = logits - logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(log_ratio < torch.log(min_p), float("-inf"))


class RowSampler:
    """Holds each row's parameters as tensors and its own random generator."""

    def __init__(
        self, configs: Sequence[SamplingConfig], seeds: Sequence[int], device: torch.device
    ) -> None:
        self.configs = list(configs)
        self.temperature = torch.tensor([c.temperature for c in configs], device=device)
        self.top_p = torch.tensor([c.top_p for c in configs], device=device)
        self.top_k = torch.tensor([c.top_k or 0 for c in configs], device=device)
        self.min_p = torch.tensor([c.min_p for c in configs], device=device)
        self.penalty = torch.tensor([c.repetition_penalty for c in configs], device=device)
        self.do_sample = [c.do_sample for c in configs]
        self.needs_penalty = any(c.repetition_penalty != 1.0 for c in configs)
        self.needs_filter = any(c.top_k or c.top_p < 1.0 for c in configs)
        self.needs_min_p = any(c.min_p > 0 for c in configs)
        self.generators = []
        for seed in seeds:
            generator = torch.Generator(device=device)
            generator.manual_seed(seed)
            self.generators.append(generator)

    def process(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """Logits [B, V] (float32) -> processed logits; filtered entries are -inf."""
        if self.needs_penalty and seen is not None:
            penalty = self.penalty[:, None]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        logits = logits / self.temperature[:, None]
        if self.needs_min_p:
            logits = filter_min_p(logits, self.min_p[:, None])
        if self.needs_filter:
            logits = self._filter(logits)
        return logits

    def _filter(self, logits: torch.Tensor) -> torch.Tensor:
        return filter_top_k_top_p(logits, self.top_k[:, None], self.top_p[:, None])

    def choose(self, processed: torch.Tensor) -> torch.Tensor:
        """Greedy rows take the argmax; sampling rows draw from their own generator."""
        chosen = processed.argmax(-1)
        if any(self.do_sample):
            probs = processed.softmax(-1)
            for row, sample in enumerate(self.do_sample):
                if sample:
                    draw = torch.multinomial(probs[row], 1, generator=self.generators[row])
                    chosen[row] = draw[0]
        return chosen
