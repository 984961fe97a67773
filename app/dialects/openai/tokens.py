"""Tokens as OpenAI's log-prob entries show them: the token's text and its bytes (a byte-level
token may hold part of a UTF-8 character; its bytes are exact where its text cannot be)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from app.common.inputs import InputPreparer
from app.dialects.openai.answers import CompletionLogprobs, TokenLogprob, TopLogprob

Tops = list[list[tuple[int, float]]] | None


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, symbol -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return {s: b for b, s in symbols.items()}


class TokenTexts:
    """Text and bytes of each token id of one model (cached)."""

    def __init__(self, preparer: InputPreparer) -> None:
        self.preparer = preparer
        self._texts: dict[int, tuple[str, list[int]]] = {}

    def text(self, token: int) -> tuple[str, list[int]]:
        found = self._texts.get(token)
        if found is None:
            found = self._texts[token] = self._describe(token)
        return found

    def _describe(self, token: int) -> tuple[str, list[int]]:
        tokenizer: Any = self.preparer.tokenizer
        text = self.preparer.decode([token])
        symbol = tokenizer.convert_ids_to_tokens(token)
        decoder = _byte_decoder()
        if token not in self.preparer.special_ids and symbol and all(c in decoder for c in symbol):
            raw = [decoder[c] for c in symbol]
        else:
            raw = list(text.encode("utf-8"))
        if "\ufffd" in text:  # part of a character: name its bytes, as vLLM does
            text = "".join(f"bytes:\\x{b:02x}" for b in raw)
        return text, raw

    def name(self, token: int, as_ids: bool) -> str:
        """How a log-prob entry names the token: its text, or vLLM's 'token_id:<id>'."""
        return f"token_id:{token}" if as_ids else self.text(token)[0]

    def chat_entries(
        self, ids: list[int], values: list[float], tops: Tops, *, as_ids: bool = False
    ) -> list[TokenLogprob]:
        entries = []
        for t, (token, value) in enumerate(zip(ids, values, strict=True)):
            raw = self.text(token)[1]
            top = [
                TopLogprob(token=self.name(i, as_ids), logprob=v, bytes=self.text(i)[1])
                for i, v in (tops[t] if tops is not None else [])
            ]
            entries.append(
                TokenLogprob(
                    token=self.name(token, as_ids), logprob=value, bytes=raw, top_logprobs=top
                )
            )
        return entries

    def completion_logprobs(
        self,
        ids: list[int],
        values: Sequence[float | None],
        tops: Tops,
        *,
        start: int = 0,
        as_ids: bool = False,
    ) -> CompletionLogprobs:
        tokens, offsets = [], []
        at = start
        for token in ids:
            tokens.append(self.name(token, as_ids))
            offsets.append(at)
            at += len(self.preparer.decode([token], skip_special=True))
        if tops is not None:
            top = [{self.name(i, as_ids): v for i, v in row} for row in tops]
        else:  # logprobs 0: each position names the chosen token alone, as vLLM answers
            top = [
                {} if v is None else {self.name(t, as_ids): v}
                for t, v in zip(ids, values, strict=False)
            ]
        return CompletionLogprobs(
            tokens=tokens,
            token_logprobs=list(values),
            top_logprobs=list[dict[str, float] | None](top),
            text_offset=offsets,
        )
