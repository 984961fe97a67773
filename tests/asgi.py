"""A client connection at the ASGI level (as uvicorn runs one), for tests of what happens when
the client goes away mid-request."""

from __future__ import annotations

import asyncio
from typing import Any


def post_scope(path: str, body: bytes) -> dict[str, Any]:
    """The scope of a JSON POST of `body` to `path`."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"rlserve"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 5000),
        "server": ("rlserve", 80),
    }


class Connection:
    """One client connection: the body, then a disconnect once `leave` is set."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.leave = asyncio.Event()
        self.body_sent = False
        self.messages: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    async def post(self, app: Any, path: str) -> None:
        """POST the body to `path` of the ASGI `app` over this connection."""
        await app(post_scope(path, self.body), self.receive, self.send)
