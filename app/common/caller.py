"""Who sends a request, as the services see it: the owner id of its API key, and whether that
key may act on what other keys own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Caller:
    owner: str = ""
    """The owner id of the request's key (`app.ops.auth.owner_of`); "" on a server without
    keys."""
    admin: bool = True
    """An admin key (RLSERVE_AUTH__ADMIN_API_KEYS), or any caller of a server without keys:
    it may change what other keys own."""

    def may_change(self, owner: str) -> bool:
        """Whether this caller may change (push to, unload, pause) a thing `owner` owns."""
        return self.admin or self.owner == owner


UNKEYED = Caller()
"""The caller of a server without keys (and of in-process use): it may change everything."""
