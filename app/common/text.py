"""Generated text as a reader gets it: cut at the first stop string, whole (`final_text`) or
as its tokens arrive (`IncrementalText`: a stop string is never shown, nor the start of one that
may still complete, nor an unfinished UTF-8 character, so the pieces add up to the whole).
Every route that returns text uses it: rlserve's, OpenAI's (streamed or not), vLLM's, SGLang's."""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


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
    """The text of a growing token list, released as it becomes certain.

    Each step decodes a short window, as vLLM's and TGI's detokenizers do: the tokens added
    since the text last settled on a whole character, after the tokens of the step before as
    context (so a tokenizer that drops a leading space at the start of a decode drops it from
    both), and keeps what the window adds past its context's own text. A stream of n tokens
    costs O(n) decoding on the event loop, not O(n^2) (bench/stream_text.py). A stop string
    can only start in the text not shown yet, so only that is searched. `full_text` decodes
    the whole list once: the reference a stream's last chunk completes."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]) -> None:
        self._decode = decode
        self._stops = stops
        self.ids: list[int] = []
        self._shown: list[str] = []  # the chunks released so far
        self.shown_length = 0
        self._held = ""  # settled text not shown yet (it may start a stop string)
        self._context = 0  # where the next window starts: the step before's tokens
        self._read = 0  # the tokens whose text has settled
        self._stopped = False

    @property
    def sent(self) -> str:
        """All the text released so far."""
        return "".join(self._shown)

    def add(self, ids: list[int]) -> str:
        """The new text that is safe to show after `ids` (maybe empty)."""
        self.ids += ids
        if self._stopped:
            return ""
        self._settle()
        text, self._stopped = cut_at_stop(self._held, self._stops)
        if not self._stopped:  # the start of a stop string may yet complete
            text = text[: len(text) - _stop_prefix_len(text, self._stops)]
        self._held = self._held[len(text) :]
        return self._show(text)

    def _settle(self) -> None:
        if self._read == len(self.ids):
            return
        context = self._decode(self.ids[self._context : self._read])
        window = self._decode(self.ids[self._context :])
        # Wait while the window ends in an unfinished character (or adds nothing); a window
        # that does not extend its context (no tokenizer known does that) waits for the
        # whole decode at the end.
        settled = len(window) > len(context) and window.startswith(context)
        if settled and not window.endswith(REPLACEMENT):
            self._held += window[len(context) :]
            self._context, self._read = self._read, len(self.ids)

    def full_text(self) -> str:
        """The whole text so far, cut at a stop string."""
        return final_text(self._decode(self.ids), self._stops)

    def finish(self) -> str:
        """Everything not shown yet, once no token will follow."""
        text, sent = self.full_text(), self.sent
        return self._show(text[len(sent) :] if text.startswith(sent) else "")

    def _show(self, text: str) -> str:
        if text:
            self._shown.append(text)
            self.shown_length += len(text)
        return text
