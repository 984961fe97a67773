"""Per-row logits processing and sampling, so rows with different parameters share a batch
(the order follows vLLM's sampler: `RowSampler`)."""

from __future__ import annotations

import hashlib
import random
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
    next one exceeds p (the most likely token always stays); a p of 1 keeps them all."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= (mass_before > top_p) & (top_p < 1.0)  # the mass's rounding can pass 1.0
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Logits [B, V] without the tokens less likely than min_p [B, 1] times the most likely
    one (0: off): removed entries are -inf."""
    log_ratio = logits - logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(log_ratio < torch.log(min_p), float("-inf"))


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V], the token where `uniform` [B] (in [0, 1)) falls in its
    cumulative distribution, summed in float64. A token of probability 0 owns an empty
    interval, so it is never drawn, nor past the last token of positive probability."""
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    point = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point[:, None], right=True).squeeze(-1)


class RowSampler:
    """Holds each row's parameters as tensors and its own random stream.

    A sampled row draws one uniform number per token from its own stream (a `random.Random`
    seeded with the row's seed, on the host: no generator per row on the device, and the
    same draws on every device) and takes the token where that number falls in the cumulative
    distribution of its processed logits (float64), all rows at once: one batched search, no
    call per row.

    The order of the processing follows vLLM's sampler: allowed tokens, bad words, min-tokens
    and logit bias; then the penalties (repetition over prompt and output, frequency and
    presence over the output); then temperature, min-p, top-k and top-p."""

    def __init__(
        self,
        configs: Sequence[SamplingConfig],
        seeds: Sequence[int],
        device: torch.device,
        eos_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.configs = list(configs)
        self.device = device
        self.temperature = torch.tensor([c.temperature for c in configs], device=device)
        self.top_p = torch.tensor([c.top_p for c in configs], device=device)
        self.top_k = torch.tensor([c.top_k or 0 for c in configs], device=device)
        self.min_p = torch.tensor([c.min_p for c in configs], device=device)
        self.penalty = torch.tensor([c.repetition_penalty for c in configs], device=device)
        self.presence = torch.tensor([c.presence_penalty for c in configs], device=device)
        self.frequency = torch.tensor([c.frequency_penalty for c in configs], device=device)
        self.do_sample = [c.do_sample for c in configs]
        self.sampled = [row for row, sample in enumerate(self.do_sample) if sample]
        self._sampled_rows = torch.tensor(self.sampled, dtype=torch.long, device=device)
        self.needs_penalty = any(c.repetition_penalty != 1.0 for c in configs)
        self.needs_counts = any(c.presence_penalty or c.frequency_penalty for c in configs)
        self.needs_filter = any(c.top_k or c.top_p < 1.0 for c in configs)
        self.needs_min_p = any(c.min_p > 0 for c in configs)
        self.constrained = any(c.constrained for c in configs)
        # What min_tokens holds back: end-of-sequence (unless ignored) and the stop ids.
        self.held = [
            sorted(set(c.stop_token_ids) | (set() if c.ignore_eos else set(eos_ids)))
            for c in configs
        ]
        self.counts: torch.Tensor | None = None  # [B, V] output-token counts
        self.fixed: torch.Tensor | None = None  # [B, V] allowed-token mask and logit bias
        self.streams = [random.Random(seeds[row]) for row in self.sampled]

    def process(
        self,
        logits: torch.Tensor,
        seen: torch.Tensor | None,
        outputs: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] (float32) -> processed logits; filtered entries are -inf. `seen`
        marks the tokens of each row's prompt and output (repetition penalty); `outputs` are
        the tokens each row generated so far (min-tokens, bad words)."""
        if self.constrained:
            logits = self._constrain(logits, outputs or [[] for _ in self.configs])
        if self.needs_penalty and seen is not None:
            penalty = self.penalty[:, None]
            penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalised, logits)
        if self.needs_counts and self.counts is not None:
            logits = logits - self.frequency[:, None] * self.counts
            logits = logits - self.presence[:, None] * (self.counts > 0)
        logits = logits / self.temperature[:, None]
        if self.needs_min_p:
            logits = filter_min_p(logits, self.min_p[:, None])
        if self.needs_filter:
            logits = self._filter(logits)
        return logits

    def observe(self, chosen: torch.Tensor) -> None:
        """Count each row's new token (frequency and presence penalties)."""
        if not self.needs_counts:
            return
        if self.counts is None:
            raise RuntimeError("observe() before process()")
        self.counts[torch.arange(len(self.configs), device=self.device), chosen] += 1

    def _constrain(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        vocab = logits.shape[-1]
        if self.fixed is None:
            self.fixed = self._fixed(vocab)
            if self.needs_counts:
                self.counts = torch.zeros((len(self.configs), vocab), device=self.device)
        logits = logits + self.fixed
        for row, (config, generated) in enumerate(zip(self.configs, outputs, strict=True)):
            if len(generated) < config.min_tokens and self.held[row]:
                held = [t for t in self.held[row] if t < vocab]
                logits[row, held] = float("-inf")
            for word in config.bad_word_ids:
                *prefix, last = word
                tail = generated[len(generated) - len(prefix) :] if prefix else []
                if len(prefix) <= len(generated) and list(tail) == prefix and last < vocab:
                    logits[row, last] = float("-inf")
        return logits

    def _fixed(self, vocab: int) -> torch.Tensor:
        """[B, V]: -inf outside each row's allowed tokens, plus its logit bias."""
        fixed = torch.zeros((len(self.configs), vocab), device=self.device)
        for row, config in enumerate(self.configs):
            if config.allowed_token_ids is not None:
                allowed = torch.full((vocab,), float("-inf"), device=self.device)
                allowed[[t for t in config.allowed_token_ids if t < vocab]] = 0.0
                fixed[row] = allowed
            for token, bias in config.logit_bias:
                if token < vocab:
                    fixed[row, token] += bias
        return fixed

    def _filter(self, logits: torch.Tensor) -> torch.Tensor:
        return filter_top_k_top_p(logits, self.top_k[:, None], self.top_p[:, None])

    def choose(self, processed: torch.Tensor) -> torch.Tensor:
        """Greedy rows take the argmax; sampling rows draw from their own stream (no copy to
        the host: the chosen ids stay on the device)."""
        if not self.sampled:
            return processed.argmax(-1)
        uniform = torch.tensor(
            [stream.random() for stream in self.streams], dtype=torch.float64
        ).to(self.device, non_blocking=True)
        every = len(self.sampled) == len(self.configs)
        logits = processed if every else processed.index_select(0, self._sampled_rows)
        drawn = inverse_cdf(logits.softmax(-1), uniform)
        if every:
            return drawn
        return processed.argmax(-1).index_copy_(0, self._sampled_rows, drawn)
