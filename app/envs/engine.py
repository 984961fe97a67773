"""The episode engine: a reset or a step of one session's episodes, from domain values to
domain values. Templating, tokenizing and decoding run on the policy's tokenizer thread,
never on the event loop; tools run in the sandbox, concurrently across rows. Sessions, locks
and the KL scoring call are the caller's (`app.envs.service`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlserve_client.sequences import SequenceSplit

from app.common.failures import Conflict, NotReady, invalid
from app.common.inputs import Conversation, InputPreparer
from app.datasets.rows import Problem
from app.envs import episodes
from app.envs.episodes import Act, ActionTokens, EpisodeState, Observation, Prompts, Row
from app.envs.rewards import Sample, by_model, first_bad_row, judge_of, score_reward
from app.envs.sandbox import Sandbox, SandboxUnavailable
from app.envs.spec import EnvSpec, KLSpec
from app.envs.tools import BlockResult, ToolBudget, run_python_blocks, tool_messages
from app.kl.estimators import per_token_kl


@dataclass(frozen=True)
class ToolLimits:
    """What one step may spend on tools: seconds across all rows, code blocks per message."""

    step_budget_s: float
    max_blocks: int


@dataclass
class Turn:
    """One row's step before its episode flags are updated."""

    action: ActionTokens
    reward: float | None
    """None: a judge gave no score (the breakdown's reward_error says why)."""
    ends_episode: bool
    breakdown: dict[str, object]
    info: dict[str, object]
    tool_results: list[BlockResult] | None = None
    read: Conversation | str | None = None
    """What a model-based reward reads of the turn: the conversation up to and including the
    action (chat), or the row's text with it (text)."""
    sample: Sample | None = None
    """What a judge reads of the turn (judge rewards only)."""


@dataclass(frozen=True)
class RowOutcome:
    """One row's answer to a step; `info` holds the reward breakdown and the answer."""

    observation: Observation
    reward: float | None
    done: bool
    terminated: bool
    truncated: bool
    info: dict[str, object]
    tool_results: list[BlockResult] | None = None

    def to_json(self, *, observation: bool = True) -> dict[str, Any]:
        """As the step's wire answer writes it (tool results first in `info`); without the
        observation when the caller can rebuild it from the row."""
        info = dict(self.info)
        if self.tool_results is not None:
            info = {"tool_results": [asdict(r) for r in self.tool_results], **info}
        data = {
            "reward": self.reward,
            "done": self.done,
            "terminated": self.terminated,
            "truncated": self.truncated,
            "info": info,
        }
        return {"observation": self.observation.to_json(), **data} if observation else data

    @classmethod
    def from_json(cls, data: dict[str, Any], observation: Observation | None = None) -> RowOutcome:
        """The outcome `to_json` wrote; `observation` stands in for one it left out."""
        info = dict(data["info"])
        runs = info.pop("tool_results", None)
        if "observation" in data:
            observation = Observation.from_json(data["observation"])
        if observation is None:
            raise ValueError("the outcome was stored without its observation; give it")
        return cls(
            observation=observation,
            reward=data["reward"],
            done=data["done"],
            terminated=data["terminated"],
            truncated=data["truncated"],
            info=info,
            tool_results=None if runs is None else [BlockResult(**r) for r in runs],
        )


@dataclass(frozen=True)
class StepResult:
    env_id: str
    policy_version: int
    outputs: list[RowOutcome] = field(default_factory=list)

    def to_json(self, *, observations: bool = True) -> dict[str, Any]:
        outputs = [o.to_json(observation=observations) for o in self.outputs]
        return {"env_id": self.env_id, "policy_version": self.policy_version, "outputs": outputs}

    @classmethod
    def from_json(
        cls, data: dict[str, Any], observations: list[Observation] | None = None
    ) -> StepResult:
        """The result `to_json` wrote; `observations` (one per row) stand in for those it
        left out."""
        given: list[Observation | None] = [None] * len(data["outputs"])
        if observations is not None:
            given = list(observations)
        outputs = [
            RowOutcome.from_json(o, ob) for o, ob in zip(data["outputs"], given, strict=True)
        ]
        return cls(data["env_id"], data["policy_version"], outputs)


class EpisodeEngine:
    """The rules of episodes; it holds no session (the caller passes the state it changes)."""

    def __init__(self, sandbox: Sandbox, limits: ToolLimits) -> None:
        self.sandbox = sandbox
        self.limits = limits

    def check_tools(self, tools: Sequence[str]) -> None:
        if "python" in tools and self.sandbox.problem is not None:
            raise invalid("tools", f"the python tool is disabled here: {self.sandbox.problem}")

    async def reset(
        self,
        config: EnvSpec,
        state: EpisodeState,
        prompts: Prompts,
        problems: list[Problem] | None,
        preparer: InputPreparer,
    ) -> list[Observation]:
        """New episodes from `prompts`, or else from the dataset's `problems`."""
        if prompts.given:
            bad = first_bad_row(config.reward, prompts.fields or [{}] * config.batch_size)
            if bad is not None:
                index, name, what = bad
                raise invalid(f"fields[{index}].{name}", f"{what} (reward '{config.reward}')")
        return await preparer.off_loop(_reset, config, state, prompts, problems, preparer)

    async def act(
        self,
        env_id: str,
        config: EnvSpec,
        state: EpisodeState,
        actions: list[Act | None],
        preparer: InputPreparer,
    ) -> list[Turn | None]:
        """Check every action (all or nothing), run their tools, append them with the tool
        results to the rows' histories and score them (without the KL penalty)."""
        if not runs_tools(config):  # nothing to wait for: one trip to the tokenizer thread
            return await preparer.off_loop(_act, env_id, config, state, actions, preparer)
        acts = await preparer.off_loop(_checked_actions, env_id, state, actions, preparer)
        deadline = asyncio.get_running_loop().time() + self.limits.step_budget_s
        budget = ToolBudget(deadline=deadline, max_blocks=self.limits.max_blocks)
        runs = await asyncio.gather(*(self._tools(config, act, budget) for act in acts))
        return await preparer.off_loop(_apply, config, state.rows, acts, runs, preparer)

    async def _tools(
        self, config: EnvSpec, act: ActionTokens | None, budget: ToolBudget
    ) -> list[BlockResult]:
        if act is None:
            return []
        try:
            return await run_python_blocks(act.text, self.sandbox, budget)
        except SandboxUnavailable as error:
            raise NotReady(f"the python tool is disabled here: {error}") from error

    async def act_and_finish(
        self,
        env_id: str,
        policy_version: int,
        config: EnvSpec,
        state: EpisodeState,
        actions: list[Act | None],
        preparer: InputPreparer,
    ) -> StepResult:
        """`act` then `finish` in one trip to the tokenizer thread, for a step with nothing
        to wait for between them: no tools to run, no KL penalty to score."""
        if runs_tools(config) or config.kl is not None or scored_after(config):
            raise ValueError("act_and_finish is for steps without tools, models to call between")
        outputs = await preparer.off_loop(_act_and_finish, env_id, config, state, actions, preparer)
        return StepResult(env_id=env_id, policy_version=policy_version, outputs=outputs)

    async def finish(
        self,
        env_id: str,
        policy_version: int,
        config: EnvSpec,
        state: EpisodeState,
        turns: list[Turn | None],
        preparer: InputPreparer,
    ) -> StepResult:
        """Count the turns, update the episode flags and observe every row."""
        outputs = await preparer.off_loop(_finish, config, state.rows, turns, preparer)
        return StepResult(env_id=env_id, policy_version=policy_version, outputs=outputs)

    async def replay(
        self, config: EnvSpec, state: EpisodeState, stored: dict[str, Any], preparer: InputPreparer
    ) -> StepResult:
        """A step's result as `StepResult.to_json` stored it, its observations rebuilt from
        the rows: the last step is forgotten at any later change, so the rows are as it left
        them, and each observation is what that step answered."""
        observations = None
        if any("observation" not in output for output in stored["outputs"]):
            observations = await preparer.off_loop(_observations, config, state.rows, preparer)
        return StepResult.from_json(stored, observations)


def runs_tools(config: EnvSpec) -> bool:
    return "python" in config.tools


def scored_after(config: EnvSpec) -> bool:
    """Whether a model scores the turns once they are taken: the reward model or a judge."""
    return by_model(config.reward) or judge_of(config.reward) is not None


def penalise_kl(
    kl: KLSpec, turns: list[Turn], scored: list[tuple[list[float], list[float]]]
) -> None:
    """Subtract coeff * KL(policy||reference) over exactly the tokens of each action, from the
    (policy, reference) log-probs of each action's full sequence."""
    for turn, (policy, reference) in zip(turns, scored, strict=True):
        mask = SequenceSplit.generated(turn.action.prompt, turn.action.ids).counted()
        value = sum(per_token_kl(policy, reference, mask, kl.estimator))
        if turn.reward is not None:  # (a judge's missing score stays missing)
            turn.reward -= kl.coeff * value
        turn.breakdown |= {"kl": value, "kl_penalty": -kl.coeff * value}


def _reset(
    config: EnvSpec,
    state: EpisodeState,
    prompts: Prompts,
    problems: list[Problem] | None,
    preparer: InputPreparer,
) -> list[Observation]:
    episodes.reset(config, state, prompts, preparer, problems)
    return [episodes.observation(config, row, preparer) for row in state.rows]


def _checked_actions(
    env_id: str, state: EpisodeState, actions: list[Act | None], preparer: InputPreparer
) -> list[ActionTokens | None]:
    rows = state.rows
    if not state.started:
        raise Conflict(f"environment '{env_id}' has not been reset")
    if len(actions) != len(rows):
        raise invalid("actions", f"has {len(actions)} entries for batch_size {len(rows)}")
    for i, (row, action) in enumerate(zip(rows, actions, strict=True)):
        if action is not None and row.done:
            raise Conflict(
                f"actions[{i}]: row {i}'s episode is done; send null or reset",
                param=f"actions[{i}]",
            )
        if action is None and not row.done:
            raise invalid(f"actions[{i}]", f"row {i} is running and needs an action")
        if action is not None and action.tokens is not None:
            preparer.check_vocabulary(action.tokens, f"actions[{i}].tokens")
    return [
        None if action is None else _fitting_action(row, action, preparer, i)
        for i, (row, action) in enumerate(zip(rows, actions, strict=True))
    ]


def _fitting_action(row: Row, action: Act, preparer: InputPreparer, index: int) -> ActionTokens:
    """The row's action as tokens, refused (422, before any row changes) when history plus
    action exceed the model's maximum length: no policy could have produced it, and a
    history past that length could only be scored by truncating it. A text far too long is
    refused before it is encoded, so step cost stays bounded by max_model_len."""
    room = preparer.max_model_len - len(row.ids)
    name = f"actions[{index}]"
    message = (
        f"row {index}'s history ({len(row.ids)} tokens) plus this action exceed the model's "
        f"maximum length of {preparer.max_model_len}; reset the episode"
    )
    if action.text is not None and preparer.certainly_longer(action.text, room):
        raise invalid(name, message)
    act = episodes.action_tokens(row, action, preparer)
    if len(act.ids) > room:
        raise invalid(name, message)
    return act


def _act(
    env_id: str,
    config: EnvSpec,
    state: EpisodeState,
    actions: list[Act | None],
    preparer: InputPreparer,
) -> list[Turn | None]:
    """`act` for sessions without tools: no tool results to wait for."""
    acts = _checked_actions(env_id, state, actions, preparer)
    return _apply(config, state.rows, acts, [[] for _ in acts], preparer)


def _act_and_finish(
    env_id: str,
    config: EnvSpec,
    state: EpisodeState,
    actions: list[Act | None],
    preparer: InputPreparer,
) -> list[RowOutcome]:
    turns = _act(env_id, config, state, actions, preparer)
    return _finish(config, state.rows, turns, preparer)


def _apply(
    config: EnvSpec,
    rows: list[Row],
    acts: list[ActionTokens | None],
    runs: list[list[BlockResult]],
    preparer: InputPreparer,
) -> list[Turn | None]:
    return [
        None if act is None else _turn(config, row, act, results, preparer)
        for row, act, results in zip(rows, acts, runs, strict=True)
    ]


def _turn(
    config: EnvSpec,
    row: Row,
    act: ActionTokens,
    results: list[BlockResult],
    preparer: InputPreparer,
) -> Turn:
    """Append one row's action and its tool results, and score it."""
    prompt = row.history[-1]["content"] if row.history else row.text
    following = tool_messages(results) if results else []
    episodes.apply_action(config, row, act, preparer, following)
    read: Conversation | str | None = None
    if by_model(config.reward):  # (what the reward model reads: the turn up to the action)
        read = row.text if row.history is None else row.history[: len(row.history) - len(following)]
    sample = Sample(act.text, row.answer, prompt, row.fields)
    result = score_reward(config.reward, config.reward_options, sample)
    info: dict[str, object] = {}
    if row.answer is not None and config.reward != "none":
        info["answer"] = row.answer
    return Turn(
        action=act,
        reward=result.reward,
        ends_episode=result.ends_episode,
        breakdown={"task": result.reward, **result.info},
        info=info,
        tool_results=results or None,
        read=read,
        sample=sample if judge_of(config.reward) is not None else None,
    )


def _finish(
    config: EnvSpec, rows: list[Row], turns: list[Turn | None], preparer: InputPreparer
) -> list[RowOutcome]:
    return [_outcome(config, row, turn, preparer) for row, turn in zip(rows, turns, strict=True)]


def _observations(config: EnvSpec, rows: list[Row], preparer: InputPreparer) -> list[Observation]:
    return [episodes.observation(config, row, preparer) for row in rows]


def _outcome(config: EnvSpec, row: Row, turn: Turn | None, preparer: InputPreparer) -> RowOutcome:
    reward: float | None = 0.0  # (a finished row stays as is)
    info, tool_results = dict[str, object](), None
    if turn is not None:
        turn.info["reward"] = turn.breakdown
        episodes.finish_turn(config, row, turn.reward, turn.ends_episode, preparer.max_model_len)
        reward, info, tool_results = turn.reward, turn.info, turn.tool_results
    return RowOutcome(
        observation=episodes.observation(config, row, preparer),
        reward=reward,
        done=row.done,
        terminated=row.terminated,
        truncated=row.truncated,
        info=info,
        tool_results=tool_results,
    )
