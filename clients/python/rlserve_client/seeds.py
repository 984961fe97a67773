"""Seed derivation of seeded episode collection. The server's `/v1/rollouts` imports it too, so
`collect` and `/v1/rollouts` give the same trajectories."""

from __future__ import annotations

import hashlib


def turn_seed(seed: int, round_index: int, turn: int) -> int:
    """The generation seed of one turn of one round (a batch of episodes in one session)."""
    digest = hashlib.blake2b(f"{seed}:{round_index}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
