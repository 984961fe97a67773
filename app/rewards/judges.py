"""Judges: a served model (the policy, the reference, the judge model or an adapter) reads a
rubric with the answer (or, in group mode, all the answers to one prompt) and answers a score.
A judge that fails, whatever the cause, fails only its rows: each gets a verdict without a
reward, carrying the reason and the judge's text, and the trainer decides what to do with it.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from app.batching import QueueFullError
from app.common.failures import NotReady, TimedOut, invalid, worded
from app.common.inputs import InputPreparer, Prepared
from app.common.roles import Role
from app.common.service import Resolved
from app.config_groups import JudgeSettings
from app.engine.registry import ModelRegistry
from app.engine.types import SamplingConfig
from app.generation.service import GenerationService

logger = logging.getLogger(__name__)

RETRYABLE = (NotReady, QueueFullError, TimedOut)
"""Failures of the moment (loading, paused past the wait, a full queue, a timeout): the step
that met one is refused whole rather than given null rewards, so sending it again can work."""


@dataclass(frozen=True)
class Judged:
    """What a judge reads of one answer."""

    prompt: str
    response: str
    answer: str | None = None
    group: int = 0
    """Answers of the same group are judged in one call (group mode)."""


@dataclass(frozen=True)
class Verdict:
    reward: float | None
    """The score mapped onto [0, 1] (or the score itself, `normalize` off); None: no score."""
    score: float | None = None
    text: str = ""
    """The judge's answer, as generated."""
    reason: str | None = None
    """Why there is no reward."""

    def info(self, judge: str) -> dict[str, object]:
        """The row's reward breakdown entries."""
        info: dict[str, object] = {"judge": judge, "judge_score": self.score}
        info["judge_text"] = self.text
        if self.reason is not None:
            info["reward_error"] = self.reason
        return info


class Judges:
    def __init__(
        self,
        registry: ModelRegistry,
        generation: GenerationService,
        judges: Mapping[str, JudgeSettings],
    ) -> None:
        self.registry = registry
        self.generation = generation
        self.judges = dict(judges)

    def check(self, name: str, param: str = "reward") -> None:
        """Refuse (naming `param`) a judge not configured, or whose model is not served."""
        judge = self.judges.get(name)
        if judge is None:
            raise invalid(
                param,
                f"unknown judge '{name}' (have {sorted(self.judges)}: judges are configured at "
                "start, RLSERVE_REWARDS__JUDGES)",
            )
        if self.registry.not_ready_reason() is not None:
            return  # (checked again when it judges)
        if not self.registry.serves(judge.model):
            raise invalid(
                param,
                f"judge '{name}' uses model '{judge.model}', which is not served (have "
                f"{', '.join(self.registry.names())})",
            )
        try:
            with worded({Role.MODEL: param}):
                served = self.registry.get(judge.model)
            choice_ids(served.preparer, judge)
        except ValueError as error:
            raise invalid(param, f"judge '{name}': {error}") from None

    async def judge(self, name: str, answers: Sequence[Judged]) -> list[Verdict]:
        """One verdict per answer, in order. The judge's own failures (its prompt, its model's
        answer, a judge no longer configured) fail its answers' rewards only; a server too
        busy or paused to answer now raises, so the step is refused whole and can be sent
        again."""
        if not answers:
            return []
        judge = self.judges.get(name)
        if judge is None:  # (a session created before a restart that dropped it)
            gone = f"judge '{name}' is no longer configured (RLSERVE_REWARDS__JUDGES)"
            return [Verdict(None, reason=gone) for _ in answers]
        try:
            calls = _calls(judge, answers)  # (a rubric's format spec can fail on its text)
            texts = await self._answer(judge, [messages for messages, _ in calls])
        except RETRYABLE:
            raise
        except Exception as error:  # (the judge failing fails the rows' rewards only)
            logger.warning("judge %s failed: %s", name, error)
            reason = f"the judge failed: {error}"
            return [Verdict(None, reason=reason) for _ in answers]
        verdicts: dict[int, Verdict] = {}  # (each answer is in exactly one call)
        for (_, members), text in zip(calls, texts, strict=True):
            if isinstance(text, Failed):
                found = [Verdict(None, reason=text.reason) for _ in members]
            elif judge.mode == "single":
                found = [read_score(judge, text)]
            else:
                found = read_scores(judge, text, len(members))
            verdicts.update(zip(members, found, strict=True))
        return [verdicts[index] for index in range(len(answers))]

    async def _answer(
        self, judge: JudgeSettings, conversations: list[list[dict[str, str]]]
    ) -> list[str | Failed]:
        """The judge model's answer to each conversation (greedy at temperature 0); a
        conversation too long for its context is not sent."""
        with worded({Role.MODEL: "reward"}):
            served = self.registry.get(judge.model)
        preparer = served.preparer

        def prepare() -> list[Prepared]:
            return [preparer.template(c, generation_prompt=True) for c in conversations]

        prepared = await preparer.off_loop(prepare)
        max_tokens = 1 if judge.choices else judge.max_tokens
        room = preparer.max_model_len - max_tokens
        fits = [i for i, p in enumerate(prepared) if len(p.ids) <= room]
        answers: list[str | Failed] = [
            Failed(
                f"the judge's prompt is {len(p.ids)} tokens: with its {max_tokens} to answer "
                f"it exceeds the judge model's context of {preparer.max_model_len}"
            )
            for p in prepared
        ]
        if not fits:
            return answers
        config = SamplingConfig(
            max_new_tokens=max_tokens,
            do_sample=judge.temperature > 0,
            temperature=judge.temperature or 1.0,
            allowed_token_ids=None if judge.choices is None else choice_ids(preparer, judge),
        )
        chosen = [prepared[i] for i in fits]
        sampled = await self.generation.sample(judge.model, chosen, Resolved(config))
        for index, generation in zip(fits, sampled.generations, strict=True):
            if generation.finish_reason == "abort":
                answers[index] = Failed("the judge's generation was aborted")
            else:
                answers[index] = preparer.decode(list(generation.token_ids), skip_special=True)
        return answers


def choice_ids(preparer: InputPreparer, judge: JudgeSettings) -> tuple[int, ...]:
    """The judge's `choices` as token ids of its model (each must be exactly one)."""
    ids = []
    for choice in judge.choices or ():
        encoded = preparer.encode(choice, special=False)
        if len(encoded) != 1:
            raise ValueError(f"choice {choice!r} is {len(encoded)} tokens of the judge model")
        ids.append(encoded[0])
    return tuple(ids)


@dataclass(frozen=True)
class Failed:
    reason: str


def _calls(
    judge: JudgeSettings, answers: Sequence[Judged]
) -> list[tuple[list[dict[str, str]], list[int]]]:
    """The judge's conversations, each with the indices of the answers it judges."""
    if judge.mode == "single":
        groups = [[i] for i in range(len(answers))]
    else:
        by_group: dict[int, list[int]] = {}
        for index, answer in enumerate(answers):
            by_group.setdefault(answer.group, []).append(index)
        groups = list(by_group.values())
    calls = []
    for members in groups:
        first = answers[members[0]]
        fields: dict[str, object] = {"prompt": first.prompt, "answer": first.answer or ""}
        if judge.mode == "single":
            fields["response"] = first.response
        else:
            fields["n"] = len(members)
            fields["responses"] = "\n\n".join(
                f"Answer {k}:\n{answers[i].response}" for k, i in enumerate(members, 1)
            )
        messages = [{"role": "user", "content": judge.rubric_text.format_map(fields)}]
        if judge.system is not None:
            messages.insert(0, {"role": "system", "content": judge.system})
        calls.append((messages, members))
    return calls


def _reward(judge: JudgeSettings, score: float, text: str) -> Verdict:
    low, high = judge.scale
    if not low <= score <= high:
        outside = f"the score {score:g} is outside the scale [{low:g}, {high:g}]"
        return Verdict(None, score, text, outside)
    reward = (score - low) / (high - low) if judge.normalize else score
    return Verdict(reward, score, text)


def read_score(judge: JudgeSettings, text: str) -> Verdict:
    """The last match of the judge's `pattern` in its answer."""
    found = [score for m in re.finditer(judge.pattern, text) if (score := _number(m, 1))]
    if not found:
        return Verdict(None, None, text, "the judge's answer has no score")
    return _reward(judge, found[-1][0], text)


def read_scores(judge: JudgeSettings, text: str, n: int) -> list[Verdict]:
    """Answer K's score from the last 'K: SCORE' match of `group_pattern` naming it."""
    scores: dict[int, float] = {}
    for match in re.finditer(judge.group_pattern, text):
        index, score = _number(match, 1), _number(match, 2)
        if index is not None and score is not None:
            scores[int(index[0])] = score[0]
    return [
        _reward(judge, scores[k], text)
        if k in scores
        else Verdict(None, None, text, f"the judge's answer scores no answer {k}")
        for k in range(1, n + 1)
    ]


def _number(match: re.Match[str], group: int) -> tuple[float] | None:
    """Group `group` of `match` as a finite number (in a tuple: 0.0 is a score too)."""
    try:
        value = float(match.group(group) or "")
    except ValueError:
        return None
    return (value,) if math.isfinite(value) else None
