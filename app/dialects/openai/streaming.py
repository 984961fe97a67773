"""Streaming: tokens from the sampling thread to the event loop, and server-sent events (the
text a stream may show so far is `app.common.text`'s)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any


@dataclass
class Tokens:
    """New tokens of one choice and the log-probs the engine sampled them with."""

    ids: list[int]
    log_probs: list[float]


class TokenStream:
    """A GenerateItem's sink: puts each batch of new tokens on an asyncio queue (callable from
    any thread)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[tuple[int, Tokens]], index: int
    ) -> None:
        self._loop = loop
        self._queue = queue
        self._index = index

    def put(self, token_ids: list[int], log_probs: list[float]) -> None:
        item = (self._index, Tokens(list(token_ids), list(log_probs)))
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)


def sse_event(data: Any) -> str:
    """One server-sent event. The JSON is ASCII: a U+2028 or a NEL in a reply would end the
    line for clients that split lines the way Python's str.splitlines does."""
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
