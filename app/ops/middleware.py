"""One ASGI middleware for what every request shares: its id (X-Request-ID, echoed or made),
Bearer auth, the body-size limit, the access log line and the request metrics."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.config import Settings
from app.errors import APIError, error_response
from app.ops.auth import ANONYMOUS, matches, owner_of
from app.ops.metrics import Metrics

access_log = logging.getLogger("rlserve.access")

PUBLIC_PATHS = frozenset({"/health", "/ready"})
ADMIN_ROUTES = frozenset({("POST", "/v1/weights/load"), ("PUT", "/v1/weights")})
_REQUEST_ID = re.compile(r"[\w.:/=+-]{1,128}")
# A route's regex ends in `$`, which also matches before a trailing newline: a path with
# control characters could reach a route that a string compare of the raw path would miss.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class ServiceMiddleware:
    def __init__(
        self, app: ASGIApp, settings: Settings, metrics: Metrics, routes: list[BaseRoute]
    ) -> None:
        self.app = app
        self.routes = routes
        self.settings = settings
        self.metrics = metrics
        self.keys = [k.encode() for k in settings.api_keys + settings.admin_api_keys]
        self.admin_keys = [k.encode() for k in settings.admin_api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        given = headers.get("x-request-id", b"").decode("latin-1")
        request_id = given if _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"] = request_id
        state["owner"] = ANONYMOUS
        started = time.perf_counter()
        status = 500
        refused = False  # a body outgrew the limit: we answered, the app's reply is dropped

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if refused:
                return
            if message["type"] == "http.response.start":
                status = message["status"]
                extra = (b"x-request-id", request_id.encode())
                message["headers"] = [*message.get("headers", []), extra]
            await send(message)

        async def refuse_body() -> None:
            nonlocal refused
            await error_response(self._too_large())(scope, receive, send_with_id)
            refused = True

        route = self._route_path(scope)
        try:
            problem = self._refuse(scope, route, headers)
            if problem is not None:
                await error_response(problem)(scope, receive, send_with_id)
            else:
                limited = self._limited(scope, route, headers, receive, refuse_body)
                await self.app(scope, limited, send_with_id)
        finally:
            self._record(scope, request_id, status, time.perf_counter() - started)

    def _refuse(self, scope: Scope, route: str, headers: dict[str, bytes]) -> APIError | None:
        """The path check (400), the auth decision (401/403) and the declared-size check (413),
        if one refuses. Auth decides on the route the router will match, never on the raw
        path, so the check and the router always judge the same thing."""
        if _CONTROL.search(scope["path"]):
            return APIError(400, "path: contains control characters", param="path")
        length = headers.get("content-length")
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared > self.settings.max_body_bytes and not _unlimited(scope, route):
            return self._too_large()
        if not self.keys or route in PUBLIC_PATHS or scope["method"] == "OPTIONS":
            return None
        if route == "/metrics" and not self.settings.metrics_auth:
            return None
        scheme, _, token = headers.get("authorization", b"").decode("latin-1").partition(" ")
        key = token.strip().encode("latin-1", "replace")
        if scheme.lower() != "bearer" or not matches(key, self.keys):
            return APIError(
                401,
                "missing or invalid API key: send 'Authorization: Bearer <key>'",
                type="authentication_error",
                headers={"WWW-Authenticate": "Bearer"},
            )
        guarded = (scope["method"], route) in ADMIN_ROUTES
        if self.admin_keys and guarded and not matches(key, self.admin_keys):
            return APIError(403, "changing weights needs an admin key", type="permission_error")
        scope["state"]["owner"] = owner_of(key)
        return None

    def _route_path(self, scope: Scope) -> str:
        """The path template of the route this request will reach (the raw path if none)."""
        route = self._match(scope)
        template = getattr(route, "path", None)
        return str(template) if template is not None else str(scope["path"])

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"request body exceeds {self.settings.max_body_bytes} bytes",
            type="request_too_large",
        )

    def _limited(
        self,
        scope: Scope,
        route: str,
        headers: dict[str, bytes],
        receive: Receive,
        refuse: Callable[[], Awaitable[None]],
    ) -> Receive:
        """`receive` for bodies without a declared size: once one grows past the limit, the
        client gets a 413 and the app sees the client go away."""
        if _unlimited(scope, route) or "content-length" in headers:
            return receive
        limit, seen = self.settings.max_body_bytes, 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    await refuse()
                    return {"type": "http.disconnect"}
            return message

        return counted

    def _match(self, scope: Scope) -> BaseRoute | None:
        """The route the router will match for this request (method and path)."""
        for route in self.routes:
            if route.matches(scope)[0] == Match.FULL:
                return route
        return None

    def _record(self, scope: Scope, request_id: str, status: int, seconds: float) -> None:
        route: Any = scope.get("route") or self._match(scope)
        template = getattr(route, "path", None) or "unmatched"
        method = scope["method"]
        self.metrics.requests.labels(template, method, str(status)).inc()
        self.metrics.latency.labels(template, method).observe(seconds)
        access_log.info(
            "%s %s %d %.1fms",
            method,
            scope["path"],
            status,
            seconds * 1000,
            extra={
                "request_id": request_id,
                "method": method,
                "route": template,
                "path": scope["path"],
                "status": status,
                "latency_ms": round(seconds * 1000, 3),
            },
        )


def _unlimited(scope: Scope, route: str) -> bool:
    """Weight uploads have their own limit (max_weights_bytes), checked while streaming."""
    return (scope["method"], route) == ("PUT", "/v1/weights")
