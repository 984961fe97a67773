"""Stable 64-bit hashes of token chains (TorchRL's LLMHashingEnv uses SipHash).

The hash of a chain is folded token by token, h_t = SipHash-2-4(key, h_{t-1} || x_t), so two
chains that share a prefix hash identically at that prefix. The key is fixed: hashes are stable
across processes, restarts and replicas."""

from __future__ import annotations

from collections.abc import Sequence

import siphashc

_KEY = b"rlserve.llm.hash"  # 16 bytes


def chain_hashes(tokens: Sequence[int]) -> list[int]:
    """The hash after each prefix length 1..len(tokens)."""
    state = siphashc.siphash(_KEY, b"")
    out = []
    for token in tokens:
        state = siphashc.siphash(_KEY, state.to_bytes(8, "little") + token.to_bytes(4, "little"))
        out.append(state)
    return out


def chain_hash(tokens: Sequence[int]) -> int:
    """Unsigned 64-bit hash of the whole chain (of the empty chain when `tokens` is empty)."""
    hashes = chain_hashes(tokens)
    return hashes[-1] if hashes else int(siphashc.siphash(_KEY, b""))
