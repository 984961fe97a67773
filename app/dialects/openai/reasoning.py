"""A reply's reasoning apart from its answer, for models that think inside `<think>...</think>`
(Qwen3, DeepSeek-R1 and their fine-tunes): vLLM's and SGLang's `--reasoning-parser` with the
`qwen3` and `deepseek_r1` names.

The text is read as it grows, and a stream's deltas add up to the non-streamed reply: both are
the same reader. Reasoning starts where the prompt left a `<think>` open (DeepSeek-R1's
template, Qwen3's thinking-only models) or where the reply opens with one; it ends at
`</think>`, and what follows is the answer. A reply that opens with anything else is an answer
for `qwen3` (Qwen3 with thinking off writes no tags) and reasoning for `deepseek_r1` (whose
template opens the tag for it), until a `</think>` ends it. The token ids are never touched:
only the text is split."""

from __future__ import annotations

from typing import Literal

from app.config_groups import ReasoningParser

START = "<think>"
END = "</think>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the prompt ends inside an open `<think>` (the reply starts in its reasoning)."""
    return prompt_text.rstrip().endswith(START)


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that starts `tag` (it may yet complete)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningReader:
    """Reads a reply's text as it grows into (reasoning, answer) pieces."""

    def __init__(self, parser: ReasoningParser, *, opened: bool) -> None:
        self._untagged = "reasoning" if parser == "deepseek_r1" else "answer"
        self._state: Literal["opening", "reasoning", "answer"] = (
            "reasoning" if opened else "opening"
        )
        self._held = ""
        self.reasoning: list[str] = []
        self.answer: list[str] = []
        self.thought = opened or parser == "deepseek_r1"

    def feed(self, text: str, *, last: bool = False) -> tuple[str, str]:
        """The new (reasoning, answer) text after `text` is added; `last`: no more follows."""
        self._held += text
        reasoning = answer = ""
        if self._state == "opening":
            head = self._held.lstrip()
            if head.startswith(START):
                self._held = head[len(START) :]
                self._state = "reasoning"
                self.thought = True
            elif START.startswith(head) and not last:
                return "", ""  # maybe the opening tag, not complete yet
            else:
                self._state = self._untagged  # type: ignore[assignment]
        if self._state == "reasoning":
            before, found, after = self._held.partition(END)
            if found:
                reasoning, self._held, self._state = before, after, "answer"
            else:
                keep = 0 if last else _partial_suffix(before, END)
                reasoning, self._held = before[: len(before) - keep], before[len(before) - keep :]
        if self._state == "answer":
            answer, self._held = self._held, ""
        self.reasoning.append(reasoning)
        self.answer.append(answer)
        return reasoning, answer

    def result(self) -> tuple[str | None, str | None]:
        """(the reasoning, or None where the reply had none; the answer, or None if empty)."""
        reasoning = "".join(self.reasoning) if self.thought else None
        return reasoning, "".join(self.answer) or None
