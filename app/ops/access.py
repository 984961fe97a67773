"""Who may call a route and how large its body may be, declared on the route itself.

A route states its policy with `openapi_extra=access(...)`; the auth and body-size middleware
read it from the route the router matched, and the OpenAPI security section is derived from
it too, so no path list is kept by hand anywhere."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from starlette.routing import BaseRoute
from starlette.types import Scope

_KEY = "x-rlserve-access"


class Access(StrEnum):
    PUBLIC = "public"
    """No key needed (probes)."""
    METRICS = "metrics"
    """Public unless the operator sets RLSERVE_AUTH__METRICS_AUTH."""
    KEY = "key"
    """Any API key (the default for every route)."""
    ADMIN = "admin"
    """An admin key when RLSERVE_AUTH__ADMIN_API_KEYS is set, else any key."""
    OWNER = "owner"
    """Any key, to a thing that key owns (a LoRA adapter): the route checks the owner, and
    lets an admin key change every owner's (`app.common.caller.Caller`)."""


class Body(StrEnum):
    LIMITED = "limited"
    """At most max_body_bytes (the default)."""
    STREAMED = "streamed"
    """Streamed to disk by the route, which enforces its own limit (weight uploads)."""


@dataclass(frozen=True)
class RoutePolicy:
    access: Access = Access.KEY
    body: Body = Body.LIMITED


DEFAULT = RoutePolicy()


def access(level: Access, body: Body = Body.LIMITED) -> dict[str, Any]:
    """`openapi_extra` declaring a route's policy (it also shows in the spec)."""
    return {_KEY: {"access": level.value, "body": body.value}}


def policy_of(route: BaseRoute | None) -> RoutePolicy:
    """The declared policy of a matched route (the default for none: unknown paths need a
    key like any other, so a 404 reveals nothing to the unauthenticated)."""
    declared = (getattr(route, "openapi_extra", None) or {}).get(_KEY)
    if declared is None:
        return DEFAULT
    return RoutePolicy(Access(declared["access"]), Body(declared["body"]))


def matched_route(scope: Scope) -> BaseRoute | None:
    """The route this request reaches, as the request-context middleware matched it once."""
    route: BaseRoute | None = scope.get("state", {}).get("route")
    return route
