"""Reward functions by name. Adding one is a single decorated function of a `Sample` (the
response, the row's answer, prompt and dataset fields); a reward with options declares them as a
pydantic model, validated when a session is created, and a reward that reads dataset fields
declares a check of them, run on every row before an episode starts."""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.common.failures import invalid

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_TAG = re.compile(r"<think>(.*?)</think>", re.DOTALL)


@dataclass
class RewardResult:
    reward: float
    ends_episode: bool = False
    info: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Sample:
    """What a reward reads of one row's turn."""

    response: str
    answer: str | None = None
    prompt: str | None = None
    """The message the response answers (chat: the last message before it, as TorchRL's
    `history.prompt[-1]`; text and tokens: the query)."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The row's extra dataset fields (e.g. IFEval's instruction_id_list and kwargs)."""


FieldCheck = Callable[[Mapping[str, Any]], "tuple[str, str] | None"]
"""A reward's check of one row's fields: None, or (field, what is wrong)."""


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Reward:
    fn: Callable[..., RewardResult]
    options: type[BaseModel] | None
    check_fields: FieldCheck | None = None
    unavailable: Callable[[], str | None] | None = None
    """Why the reward cannot run on this server (a package missing), or None."""
    by_model: bool = False
    """Scored by the served reward model after the turn (`fn` only holds its place)."""


MODEL = "model"
"""The reward the served reward model gives (`--reward-model`): each turn's conversation (or
text) as the reward model reads it, scored in one batched call per step."""

REWARDS: dict[str, Reward] = {}
"""What `register_reward` registered; read it through `rewards()`."""
REWARD_MODULES = ("app.envs.ifeval",)
"""The modules besides this one whose rewards ship with the server: a new one is named here,
once, and registers its rewards when imported."""


JUDGE = "judge:"
"""`reward: "judge:NAME"`: each answer scored by judge NAME (`rewards.judges`) once the turn
is taken, in one batched call per step (`app.rewards.judges`)."""


def rewards() -> dict[str, Reward]:
    """Every reward: this module's, the shipped modules' (imported on first use, so this
    module needs none of them to load) and any registered since."""
    for module in REWARD_MODULES:
        importlib.import_module(module)
    return REWARDS


def register_reward(
    name: str,
    *,
    options: type[BaseModel] | None = None,
    check_fields: FieldCheck | None = None,
    unavailable: Callable[[], str | None] | None = None,
    by_model: bool = False,
) -> Callable[[Callable[..., RewardResult]], Callable[..., RewardResult]]:
    """`@register_reward("name")` makes `reward: "name"` available to environments. The
    function takes a `Sample`, plus the parsed options when `options` is given.
    `check_fields` vets each row's dataset fields before its episode starts (422 when wrong);
    `unavailable` says why the reward cannot run here (sessions asking for it get a 422)."""

    def decorate(fn: Callable[..., RewardResult]) -> Callable[..., RewardResult]:
        REWARDS[name] = Reward(fn, options, check_fields, unavailable, by_model)
        return fn

    return decorate


def reward_of(name: str) -> Reward:
    """The registered reward `name`, or a judge's (`judge:NAME`); KeyError for another."""
    known = rewards()
    if name in known:
        return known[name]
    if name.startswith(JUDGE):
        return JUDGED
    raise KeyError(name)


def judge_of(name: str) -> str | None:
    """The judge that gives reward `name`, or None for a reward of another kind."""
    return name.removeprefix(JUDGE) if name.startswith(JUDGE) else None


def parse_options(name: str, options: dict[str, Any]) -> BaseModel:
    """The reward's options, or a 422 naming `reward_options.<field>`."""
    model = reward_of(name).options or NoOptions
    try:
        return model.model_validate(options)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise invalid(f"reward_options.{where}", f"{first['msg']} (reward '{name}')") from None


def score_reward(name: str, options: dict[str, Any], sample: Sample) -> RewardResult:
    reward = reward_of(name)
    if reward.options is None:
        return reward.fn(sample)
    return reward.fn(sample, parse_options(name, options))


def first_bad_row(name: str, rows: Iterable[Mapping[str, Any]]) -> tuple[int, str, str] | None:
    """The first row whose fields this reward cannot score: (index, field, what is wrong)."""
    check = reward_of(name).check_fields
    if check is None:
        return None
    for index, fields in enumerate(rows):
        if (problem := check(fields)) is not None:
            return index, *problem
    return None


async def require(name: str, param: str = "reward") -> None:
    """A 422 naming `param` unless `name` is a reward this server can run."""
    known = rewards()
    if name not in known and judge_of(name) is None:
        raise invalid(param, f"unknown reward '{name}' (have {sorted(known)}, or judge:NAME)")
    check = reward_of(name).unavailable
    if check is not None and (problem := await asyncio.to_thread(check)) is not None:
        raise invalid(param, f"reward '{name}' cannot run on this server: {problem}")


@register_reward("none")
def no_reward(sample: Sample) -> RewardResult:
    return RewardResult(0.0)


@register_reward(MODEL, by_model=True)
def model_reward(sample: Sample) -> RewardResult:
    return RewardResult(0.0)  # (the reward model's or a judge's, set once it has scored)


JUDGED = Reward(model_reward, None)
"""Every judge's entry (`judge:NAME`): its `fn` holds the place of the judge's verdict."""


def by_model(name: str) -> bool:
    """Whether reward `name` is the served reward model's."""
    return reward_of(name).by_model


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
    set_done_if_answer: bool = Field(
        default=True, description="A given answer ends the episode (TorchRL's default)."
    )


@register_reward("gsm8k", options=GSM8KOptions)
def gsm8k_reward(sample: Sample, options: GSM8KOptions) -> RewardResult:
    """TorchRL's GSM8KRewardParser: correct_reward for a right `<answer>`, format_reward for a
    wrong one, 0.0 without one; an empty `<answer></answer>` is no answer. A given answer ends
    the episode unless set_done_if_answer is off."""
    response, answer = sample.response, sample.answer
    tags = [tag.strip() for tag in ANSWER_TAG.findall(response)]
    given = "" if not tags else tags[0] if options.answer_tag == "first" else tags[-1]
    think = THINK_TAG.search(response)
    has_answer, has_think = bool(given), bool(think and think.group(1).strip())
    expected = ground_truth(answer) if answer is not None else None
    correct = has_answer and expected is not None and normalize_number(given) == expected
    right = options.correct_reward if correct else options.format_reward if has_answer else 0.0
    return RewardResult(
        right,
        ends_episode=has_answer and options.set_done_if_answer,
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


NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


class NumberOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    which: Literal["last", "first"] = Field(
        default="last",
        description="Which number of the response is its answer. last (as lm-eval's GSM8K "
        "flexible-extract filter reads a free-form reply): the number it ends on.",
    )
    correct_reward: float = Field(default=1.0, allow_inf_nan=False)


@register_reward("number", options=NumberOptions)
def number_reward(sample: Sample, options: NumberOptions) -> RewardResult:
    """correct_reward when the response's last (or first) number equals the answer (GSM8K's
    `#### N`, or a bare number), compared as normalize_number leaves them; 0.0 otherwise. No
    answer format is asked of the model, so a small model earns reward from its first step."""
    numbers = NUMBER.findall(sample.response)
    given = normalize_number(numbers[-1 if options.which == "last" else 0]) if numbers else None
    expected = ground_truth(sample.answer) if sample.answer is not None else None
    correct = given is not None and given == expected
    return RewardResult(
        options.correct_reward if correct else 0.0,
        info={"given": given, "expected": expected, "correct": correct, "success": correct},
    )


def reward_names_schema(schema: dict[str, Any]) -> None:
    """A `json_schema_extra` hook: the field names one of the rewards registered when the
    spec is made (a name outside them is refused), null kept where the field allows it."""
    names: list[str | None] = [*sorted(rewards())]
    nullable = any(option.get("type") == "null" for option in schema.get("anyOf", ()))
    if nullable:
        names.append(None)
    judges = {"type": "string", "pattern": f"^{JUDGE}[A-Za-z0-9_.-]{{1,64}}$"}
    schema.pop("type", None)
    schema["anyOf"] = [{"enum": names}, judges]
