"""The request body limit (max_body_bytes), on the declared size and while the body streams;
routes that declare a streamed body (`Body.STREAMED`) enforce their own limit instead."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response
from app.ops.access import Body, matched_route, policy_of


def declared_size(headers: Headers) -> int | None:
    """The body size a request declares (its Content-Length; None: chunked, or not a
    number, which the server then counts as it streams)."""
    length = headers.get("content-length")
    if length is None or not (length.isascii() and length.isdigit()):
        return None
    return int(length)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or policy_of(matched_route(scope)).body is Body.STREAMED:
            await self.app(scope, receive, send)
            return
        declared = declared_size(Headers(scope=scope))
        if declared is not None:
            if declared > self.limit:
                await error_response(self._too_large())(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        refused = False  # the body outgrew the limit: we answered, the app's reply is dropped
        seen = 0

        async def counted() -> Message:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit and not refused:
                    await error_response(self._too_large())(scope, receive, send)
                    refused = True
                    return {"type": "http.disconnect"}
            return message

        async def send_unless_refused(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counted, send_unless_refused)
        except Exception:
            # The app read the disconnect it was told of (Starlette's ClientDisconnect):
            # the 413 went out, and that is the request's end, not a server error.
            if not refused:
                raise

    def _too_large(self) -> APIError:
        return APIError(
            413,
            f"body: the request body exceeds {self.limit} bytes (http.max_body_bytes, "
            "RLSERVE_HTTP__MAX_BODY_BYTES; weight and adapter uploads have their own limits)",
            type="request_too_large",
            param="body",
        )
