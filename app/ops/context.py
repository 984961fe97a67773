"""The outermost middleware: what every request gets whatever happens to it. Its id
(X-Request-ID, echoed or made), the route it will reach (matched once, read by the auth and
body-size middleware), a 400 for paths with control characters, one error body with the id
for an unexpected failure or a request cancelled at shutdown, the access log line and the
request metrics (status 499 for a request whose client went away before its answer)."""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid

from starlette.datastructures import Headers
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response
from app.ops.auth import ANONYMOUS
from app.ops.metrics import Metrics

access_log = logging.getLogger("rlserve.access")
_PROBES = frozenset({"/health", "/live", "/ready", "/metrics"})
logger = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[\w.:/=+-]{1,128}")
# A route's regex ends in `$`, which also matches before a trailing newline: a path with
# control characters could reach a route that a check of the raw path would judge otherwise.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MATCHES_KEPT = 4096
MATCHED_PATH_CHARS = 256


class RequestContextMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics,
        routes: list[BaseRoute],
        replica: str | None = None,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        self.stamp = [(b"x-request-id", b"")]
        self._matched = functools.lru_cache(maxsize=MATCHES_KEPT)(self._scan)
        if replica is not None:  # which replica answered (behind Ray Serve's proxy)
            self.stamp.append((b"x-rlserve-replica", replica.encode()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given_id = Headers(scope=scope).get("x-request-id", "")
        request_id = given_id if _REQUEST_ID.fullmatch(given_id) else uuid.uuid4().hex
        route = self._match(scope)
        state = scope.setdefault("state", {})
        state.update(request_id=request_id, owner=ANONYMOUS, route=route)
        started = time.perf_counter()
        status, sent, gone = 500, False, False

        async def receive_noting_disconnect() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def send_with_id(message: Message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status, sent = message["status"], True
                stamp = [(b"x-request-id", request_id.encode()), *self.stamp[1:]]
                message["headers"] = [*message.get("headers", []), *stamp]
            await send(message)

        try:
            if _CONTROL.search(scope["path"]):
                problem = APIError(400, "path: contains control characters", param="path")
                await error_response(problem)(scope, receive, send_with_id)
            else:
                await self.app(scope, receive_noting_disconnect, send_with_id)
        except Exception as exc:
            # Here, not in an exception handler: Starlette runs those outside every
            # middleware, so their 500 would go out without the request id.
            logger.exception(
                "unhandled error on %s %s",
                scope["method"],
                scope["path"],
                extra={"request_id": request_id},
            )
            if not sent:
                await error_response(_internal_error(exc))(scope, receive, send_with_id)
            status = 500
        except asyncio.CancelledError:
            if gone and not sent:
                # Its client went away (nginx's 499 "client closed request") and its work was
                # dropped: a normal end, said by the access log's one line. Not re-raised,
                # or the server would log it as a crash.
                status = 499
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                return
            if not sent:
                # uvicorn cancels what still runs when the shutdown grace (shutdown_timeout_s)
                # is over: the client gets an answer it may retry, not a bare 500 or nothing.
                await error_response(_cancelled())(scope, receive, send_with_id)
            raise
        finally:
            self._record(scope, route, request_id, status, time.perf_counter() - started)

    def _match(self, scope: Scope) -> BaseRoute | None:
        """The route the router will match for this request: a function of its method and
        path alone, remembered for the last MATCHES_KEPT of them (a route's match runs its
        regex, and a late route's takes every earlier one's). Long paths are not kept, so the
        memory kept stays small whatever paths clients send."""
        method, path, root_path = scope["method"], scope["path"], scope.get("root_path", "")
        if len(path) + len(root_path) > MATCHED_PATH_CHARS:
            return self._scan(method, path, root_path)
        return self._matched(method, path, root_path)

    def _scan(self, method: str, path: str, root_path: str) -> BaseRoute | None:
        scope = {"type": "http", "method": method, "path": path, "root_path": root_path}
        for route in self.routes:
            if route.matches(scope)[0] == Match.FULL:
                return route
        return None

    def _record(
        self, scope: Scope, route: BaseRoute | None, request_id: str, status: int, seconds: float
    ) -> None:
        template = getattr(route, "path", None) or "unmatched"
        method = scope["method"]
        self.metrics.requests.labels(template, method, str(status)).inc()
        self.metrics.latency.labels(template, method).observe(seconds)
        # Probes answered as probes are (a load balancer's or a start script's polling) stay
        # out of the INFO log; anything else they answer, and every other route, is in it.
        quiet = template in _PROBES and status in (200, 503)
        access_log.log(
            logging.DEBUG if quiet else logging.INFO,
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


def _cancelled() -> APIError:
    return APIError(
        503,
        "request cancelled before it finished: the server is shutting down; retry it",
        type="unavailable_error",
        headers={"Retry-After": "1"},
    )


def _internal_error(exc: Exception) -> APIError:
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")
