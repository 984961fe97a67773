"""Reward functions by name. Adding one is a single decorated function; a reward with options
declares them as a pydantic model, validated when a session is created."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.common.failures import invalid

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_TAG = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclass
class RewardResult:
    reward: float
    ends_episode: bool = False
    info: dict[str, object] = field(default_factory=dict)


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Reward:
    fn: Callable[..., RewardResult]
    options: type[BaseModel] | None


REWARDS: dict[str, Reward] = {}


def register_reward(
    name: str, *, options: type[BaseModel] | None = None
) -> Callable[[Callable[..., RewardResult]], Callable[..., RewardResult]]:
    """`@register_reward("name")` makes `reward: "name"` available to environments. The
    function takes `(response, answer)`, plus the parsed options when `options` is given."""

    def decorate(fn: Callable[..., RewardResult]) -> Callable[..., RewardResult]:
        REWARDS[name] = Reward(fn, options)
        return fn

    return decorate


def parse_options(name: str, options: dict[str, Any]) -> BaseModel:
    """The reward's options, or a 422 naming `reward_options.<field>`."""
    model = REWARDS[name].options or NoOptions
    try:
        return model.model_validate(options)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise invalid(f"reward_options.{where}", f"{first['msg']} (reward '{name}')") from None


def score_reward(
    name: str, options: dict[str, Any], response: str, answer: str | None
) -> RewardResult:
    reward = REWARDS[name]
    if reward.options is None:
        return reward.fn(response, answer)
    return reward.fn(response, answer, parse_options(name, options))


@register_reward("none")
def no_reward(response: str, answer: str | None) -> RewardResult:
    return RewardResult(0.0)


def normalize_number(text: str) -> str:
    """Drop `,` `$` `%` and surrounding space, a trailing `.` and trailing decimal zeros.
    Unlike TorchRL, space left after removing `$`/`%` is stripped too ("$ 12" is "12")."""
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


class GSM8KOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    answer_tag: Literal["first", "last"] = Field(
        default="first",
        description="Which <answer> tag is scored when there are several. first (TorchRL's "
        "choice): the answer that ends the episode; last: the model's final answer.",
    )
    correct_reward: float = Field(default=1.0, allow_inf_nan=False)
    format_reward: float = Field(
        default=0.1, allow_inf_nan=False, description="A non-empty but wrong answer."
    )


@register_reward("gsm8k", options=GSM8KOptions)
def gsm8k_reward(response: str, answer: str | None, options: GSM8KOptions) -> RewardResult:
    """TorchRL's GSM8KRewardParser: correct_reward for a right `<answer>`, format_reward for a
    wrong one, 0.0 without one; an empty `<answer></answer>` is no answer. A given answer ends
    the episode."""
    tags = [tag.strip() for tag in _ANSWER_TAG.findall(response)]
    given = "" if not tags else tags[0] if options.answer_tag == "first" else tags[-1]
    think = _THINK_TAG.search(response)
    has_answer, has_think = bool(given), bool(think and think.group(1).strip())
    expected = ground_truth(answer) if answer is not None else None
    correct = has_answer and expected is not None and normalize_number(given) == expected
    right = options.correct_reward if correct else options.format_reward if has_answer else 0.0
    return RewardResult(
        right,
        ends_episode=has_answer,
        info={
            "answer_given": has_answer,
            "think": has_think,
            "right": right,
            "success": correct,
            "given": normalize_number(given) if has_answer else None,
            "expected": expected,
            "correct": correct,
        },
    )
