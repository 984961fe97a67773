"""API keys: the auth middleware, checking a key in constant time, and the owner id a key
stands for.

Sessions (and everything else a caller creates) belong to an owner: a digest of the key that
created them, never the key itself, so the store holds nothing that would authenticate."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from app.config_groups import AuthSettings
from app.errors import APIError, error_response
from app.ops.access import Access, matched_route, policy_of

ANONYMOUS = ""  # the owner of everything when the server has no keys
logger = logging.getLogger(__name__)


class OpenStart(ValueError):
    """A server without API keys that would listen beyond loopback: the start stops."""


def loopback(host: str) -> bool:
    """Whether `host` (an address to listen on) is reachable from this machine alone."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any interface


def check_exposure(settings: AuthSettings, host: str | None) -> None:
    """Before a server starts listening on `host` (None: an address this process cannot know,
    such as a Ray Serve config's proxy): without API keys, on loopback it starts with a
    warning, and elsewhere only when `auth.allow_no_keys` says so on purpose (logged);
    otherwise `OpenStart`."""
    if settings.api_keys or settings.admin_api_keys:
        return
    where = "an address this process cannot see" if host is None else host
    if host is not None and loopback(host):
        logger.warning(
            "no API keys: every route is open to whoever reaches %s on this machine "
            "(RLSERVE_AUTH__API_KEYS sets keys)",
            host,
        )
    elif settings.allow_no_keys:
        logger.warning(
            "no API keys, listening on %s: every route (weights and trajectories included) "
            "is open to whoever reaches it, as auth.allow_no_keys says",
            where,
        )
    else:
        raise OpenStart(
            f"no API keys, and the server would listen on {where}, beyond loopback: set "
            "RLSERVE_AUTH__API_KEYS (comma-separated keys), or RLSERVE_AUTH__ALLOW_NO_KEYS=true "
            "to serve open on purpose"
        )


def matches(key: bytes, keys: list[bytes]) -> bool:
    """Compare with every key in constant time (no early exit on the first match)."""
    found = False
    for candidate in keys:
        found |= hmac.compare_digest(key, candidate)
    return found


def presented_key(headers: Headers) -> bytes | None:
    """The key a request presents: a bearer key, else `x-api-key` (Anthropic's header)."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode("latin-1", "replace")
    if (given := headers.get("x-api-key")) is not None:
        return given.strip().encode("latin-1", "replace")
    return None


def owner_of(key: bytes) -> str:
    return "key-" + hashlib.sha256(b"rlserve-owner:" + key).hexdigest()[:32]


class AuthMiddleware:
    """Bearer keys, judged on the policy the matched route declares (`app.ops.access`): 401
    without a valid key, 403 for a non-admin key on an admin route. Sets the request's owner,
    and whether its key is an admin key (one that may change what other keys own: without
    admin keys, no key may)."""

    def __init__(self, app: ASGIApp, settings: AuthSettings) -> None:
        self.app = app
        self.settings = settings
        self.keys = [k.encode() for k in settings.api_keys + settings.admin_api_keys]
        self.admin_keys = [k.encode() for k in settings.admin_api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = self._refuse(scope)
            if problem is not None:
                await error_response(problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refuse(self, scope: Scope) -> APIError | None:
        level = policy_of(matched_route(scope)).access
        # (OPTIONS too: a 405 for a route and a 404 for none would tell the unauthenticated
        # which routes exist. Browsers' CORS preflights are answered before this, by the CORS
        # middleware, where origins are configured.)
        if not self.keys or level is Access.PUBLIC:
            return None
        if level is Access.METRICS and not self.settings.metrics_auth:
            return None
        key = presented_key(Headers(scope=scope))
        if key is None or not matches(key, self.keys):
            return APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>' (or "
                "'x-api-key: <key>', as Anthropic's clients do)",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        admin = matches(key, self.admin_keys)
        if level is Access.ADMIN and self.admin_keys and not admin:
            return APIError(403, "this route needs an admin key", type="permission_error")
        scope["state"]["owner"] = owner_of(key)
        scope["state"]["admin"] = admin
        return None
