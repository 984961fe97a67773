"""API keys: checking one in constant time, and the owner id it stands for.

Sessions (and everything else a caller creates) belong to an owner: a digest of the key that
created them, never the key itself, so the store holds nothing that would authenticate."""

from __future__ import annotations

import hashlib
import hmac

ANONYMOUS = ""  # the owner of everything when the server has no keys


def matches(key: bytes, keys: list[bytes]) -> bool:
    """Compare with every key in constant time (no early exit on the first match)."""
    found = False
    for candidate in keys:
        found |= hmac.compare_digest(key, candidate)
    return found


def owner_of(key: bytes) -> str:
    return "key-" + hashlib.sha256(b"rlserve-owner:" + key).hexdigest()[:32]
