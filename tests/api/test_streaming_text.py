"""The text a stream shows as tokens arrive: chunks add up to the whole decode cut at the
first stop string, for any chunking, and each step decodes a short window, not the list."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from app.common.text import IncrementalText

TEXT = "Hello wörld! 你好, 世界 🙂🎉 naïve café — done. Stop here: END and more 😀 after."


class Counting:
    """A decode that counts the tokens it is given."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.tokens = 0

    def __call__(self, ids: list[int]) -> str:
        self.tokens += len(ids)
        return self.decode(ids)


def reference(decode: Callable[[list[int]], str], ids: list[int], stops: list[str]) -> str:
    """The non-streamed reply: everything decoded at once, cut at the first stop string."""
    text = decode(ids)
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else text


def stream(text: IncrementalText, ids: list[int], rng: random.Random) -> list[str]:
    chunks, at = [], 0
    while at < len(ids):
        size = rng.choice([1, 1, 1, 2, 3, 7])
        chunks.append(text.add(ids[at : at + size]))
        at += size
    chunks.append(text.finish())
    return chunks


def sentencepiece_like() -> tuple[Callable[[list[int]], str], list[int]]:
    """Word pieces with a space marker that a decode drops at its very start, as
    SentencePiece decoders do: a window decoded alone would lose its first space."""
    pieces = ["▁The", "▁cat", "▁sat", "s", "▁on", "▁the", "▁mat", ".", "▁END", "▁ok"]

    def decode(ids: list[int]) -> str:
        return "".join(pieces[i] for i in ids).replace("▁", " ").removeprefix(" ")

    rng = random.Random(5)
    return decode, [rng.randrange(len(pieces)) for _ in range(300)]


@pytest.mark.parametrize("stops", [[], ["END"], ["🎉"], ["wörld", "xyz"], ["e."], ["after.x"]])
def test_chunks_add_up_to_the_whole_decode_cut_at_a_stop(hf_tokenizer, stops):
    def decode(ids: list[int]) -> str:
        return hf_tokenizer.decode(ids, skip_special_tokens=True)

    ids = hf_tokenizer.encode(TEXT * 3)
    want = reference(decode, ids, stops)
    for seed in range(5):
        text = IncrementalText(decode, stops)
        chunks = stream(text, ids, random.Random(seed))
        assert "".join(chunks) == want
        assert text.sent == want
        assert not any(c.endswith("\ufffd") for c in chunks)  # no half character shown


def test_a_decode_that_drops_its_leading_space():
    decode, ids = sentencepiece_like()
    for stops in ([], ["END"], [" ok ok"]):
        want = reference(decode, ids, stops)
        shown = IncrementalText(decode, stops)
        chunks = [shown.add([i]) for i in ids]
        assert "".join(chunks) + shown.finish() == want
        assert "".join(chunks) == want  # settled as it went: nothing was left for the end


def test_each_step_decodes_a_window_not_the_whole_list(hf_tokenizer):
    counting = Counting(lambda ids: hf_tokenizer.decode(ids, skip_special_tokens=True))
    ids = hf_tokenizer.encode(TEXT * 40)
    text = IncrementalText(counting, [])
    for token in ids:
        text.add([token])
    # A whole-list decode per step would be len(ids)**2 / 2 tokens (about 4.5 million here).
    assert counting.tokens < 12 * len(ids)
    assert text.sent == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_invalid_bytes_are_shown_once_a_character_follows(hf_tokenizer):
    def decode(ids: list[int]) -> str:
        return hf_tokenizer.decode(ids, skip_special_tokens=True)

    rng = random.Random(1)
    # Byte tokens at random: lone continuation bytes and cut-off sequences among valid text.
    ids = [rng.randrange(256) for _ in range(600)] + hf_tokenizer.encode("tail")
    text = IncrementalText(decode, [])
    chunks = stream(text, ids, rng)
    assert "".join(chunks) == decode(ids)
    assert chunks[-1] == ""  # the last token closed every character: nothing was left
