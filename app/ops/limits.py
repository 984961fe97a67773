"""The request body limit (max_body_bytes), on the declared size and while the body streams;
routes that declare a streamed body (`Body.STREAMED`) enforce their own limit instead."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import APIError, error_response
from app.ops.access import Body, matched_route, policy_of


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or policy_of(matched_route(scope)).body is Body.STREAMED:
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None:
            declared = int(length) if length.isascii() and length.isdigit() else 0
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

        await self.app(scope, counted, send_unless_refused)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.limit} bytes", type="request_too_large")
