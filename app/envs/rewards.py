"""Reward functions by name. Adding one is a single decorated function."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass
class RewardResult:
    reward: float
    ends_episode: bool = False
    info: dict[str, object] = field(default_factory=dict)


RewardFn = Callable[[str, "str | None"], RewardResult]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """`@register_reward("name")` makes `reward: "name"` available to environments."""

    def decorate(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn

    return decorate


@register_reward("none")
def no_reward(response: str, answer: str | None) -> RewardResult:
    return RewardResult(0.0)


def normalize_number(text: str) -> str:
    """Drop `,` `$` `%`, surrounding space, a trailing `.` and trailing decimal zeros."""
    text = text.strip()
    for char in ",$%":
        text = text.replace(char, "")
    text = text.strip().rstrip(".")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def ground_truth(answer: str) -> str:
    """GSM8K answers end with `#### <number>`; a bare answer is taken as it is."""
    return normalize_number(answer.split("#### ")[-1])


@register_reward("gsm8k")
def gsm8k_reward(response: str, answer: str | None) -> RewardResult:
    """1.0 for a correct `<answer>`, 0.1 for a wrong one, 0.0 without the tag. A tag ends the
    episode."""
    tags = _ANSWER_TAG.findall(response)
    if not tags:
        return RewardResult(0.0, info={"answer_tag": False})
    given = normalize_number(tags[-1])
    expected = ground_truth(answer) if answer is not None else None
    correct = expected is not None and given == expected
    return RewardResult(
        1.0 if correct else 0.1,
        ends_episode=True,
        info={"answer_tag": True, "given": given, "expected": expected, "correct": correct},
    )
