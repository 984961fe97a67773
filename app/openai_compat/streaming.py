"""Streaming: tokens from the sampling thread to the event loop, and the text a stream may show
so far (a stop string is never shown, nor the start of one that may still complete, nor an
unfinished UTF-8 character), so the chunks of a stream add up to the non-streamed reply."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


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


def cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    """`text` up to the first stop string (excluded), and whether one occurred."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """The longest end of `text` that is the start of a stop string (it may yet complete)."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def final_text(text: str, stops: list[str]) -> str:
    return cut_at_stop(text, stops)[0]


class IncrementalText:
    """The text of a growing token list, released as it becomes certain."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._stops = stops
        self.ids: list[int] = []
        self.sent = ""

    def add(self, ids: list[int]) -> str:
        """The new text that is safe to show after `ids` (maybe empty)."""
        self.ids += ids
        text, stopped = cut_at_stop(self._decode(self.ids), self._stops)
        if not stopped:
            text = text.rstrip(REPLACEMENT)  # an unfinished character may complete later
            text = text[: len(text) - _stop_prefix_len(text, self._stops)]
        return self._release(text)

    def full_text(self) -> str:
        """The whole text so far, cut at a stop string."""
        return final_text(self._decode(self.ids), self._stops)

    def finish(self) -> str:
        """Everything not shown yet, once no token will follow."""
        return self._release(self.full_text())

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""
        new, self.sent = text[len(self.sent) :], text
        return new
