"""Requests that pin the policy version: a minimum or an exact one. Set per request by the
edge (`app.ops.versions`) and checked by the serving gate at admission, so every route whose
work is admitted (generation, scoring, KL, environment steps, the dialects' routes) honours a
pin without saying so. What a request was admitted at is noted in its `Noted` record, which
the edge reports with the answer."""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pin:
    minimum: int | None = None
    exact: int | None = None

    def waits_for(self, served: int) -> bool:
        """The version served is below what the request needs (a later one may come)."""
        wanted = self.exact if self.exact is not None else self.minimum
        return wanted is not None and served < wanted

    def passed(self, served: int) -> bool:
        """The exact version asked for was served before: it never comes back."""
        return self.exact is not None and served > self.exact


@dataclass
class Noted:
    """What the gate noted of one request: the policy version its work was admitted at."""

    admitted: int | None = None
    pin: Pin = field(default_factory=Pin)


REQUEST: contextvars.ContextVar[Noted | None] = contextvars.ContextVar("pin", default=None)
