"""The reasoning reader alone: each parser's rule on whole replies, and a reply fed in any
pieces (a stream's deltas) reads the same as fed whole."""

from __future__ import annotations

import random

import pytest

from app.config_groups import ReasoningParser
from app.dialects.openai.reasoning import ReasoningReader, prompt_opens_thinking

CASES = [
    # (parser, the prompt left <think> open, reply, expected (reasoning, answer))
    ("qwen3", False, "<think>\nhm\n</think>\n\nYes.", ("\nhm\n", "\n\nYes.")),
    ("qwen3", False, "  <think>hm</think>", ("hm", None)),
    ("qwen3", False, "<think>still thinking", ("still thinking", None)),
    ("qwen3", False, "Yes. <think>x</think>", (None, "Yes. <think>x</think>")),
    ("qwen3", False, "<thin", (None, "<thin")),
    ("qwen3", False, "", (None, None)),
    ("qwen3", True, "hm\n</think>\n\nYes.", ("hm\n", "\n\nYes.")),
    ("deepseek_r1", False, "hm</think>Yes.", ("hm", "Yes.")),
    ("deepseek_r1", False, "hm, no end", ("hm, no end", None)),
    ("deepseek_r1", False, "<think>hm</think>Yes.", ("hm", "Yes.")),
    ("deepseek_r1", True, "</think>Yes.", ("", "Yes.")),
]


def split_reasoning(
    text: str, parser: ReasoningParser, *, opened: bool
) -> tuple[str | None, str | None]:
    """A whole reply's (reasoning, answer): the reader fed it at once."""
    reader = ReasoningReader(parser, opened=opened)
    reader.feed(text, last=True)
    return reader.result()


@pytest.mark.parametrize(("parser", "opened", "text", "expected"), CASES)
def test_whole_replies(parser, opened, text, expected):
    assert split_reasoning(text, parser, opened=opened) == expected


@pytest.mark.parametrize(("parser", "opened", "text", "expected"), CASES)
def test_a_reply_in_pieces_reads_as_the_whole(parser, opened, text, expected):
    rng = random.Random(text)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        reader = ReasoningReader(parser, opened=opened)
        reasoning = answer = ""
        for k, piece in enumerate(pieces):
            r, a = reader.feed(piece, last=k == len(pieces) - 1)
            reasoning, answer = reasoning + r, answer + a
        assert reader.result() == expected
        assert (reasoning, answer) == (expected[0] or "", expected[1] or "")


def test_a_prompt_opens_thinking_when_it_ends_in_the_tag():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
