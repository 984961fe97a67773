"""Environment sessions: create, reset, step, inspect, delete. The orchestrator between the
session repository (storage, locks, quotas) and the episode engine (the episodes' rules); it
adds what needs other services: datasets, the policy's tokenizer and the KL scoring call."""

from __future__ import annotations

from collections.abc import Callable

from app.common.failures import Conflict, invalid, worded
from app.common.inputs import InputPreparer, Prepared
from app.common.roles import Role
from app.datasets.rows import Problem
from app.datasets.service import DatasetService
from app.engine.registry import ModelRegistry
from app.envs.engine import EpisodeEngine, StepResult, Turn, penalise_kl, runs_tools, scored_after
from app.envs.episodes import Act, EpisodeState, Observation, Prompts
from app.envs.rewards import Sample, by_model, judge_of, parse_options, require
from app.envs.sessions import SessionRepository, SessionView
from app.envs.spec import EnvSpec
from app.rewards.judges import Judged, Judges

NO_PROMPTS = Prompts()


class EnvService:
    def __init__(
        self,
        sessions: SessionRepository,
        engine: EpisodeEngine,
        registry: ModelRegistry,
        datasets: DatasetService,
        judges: Judges,
        *,
        max_turns: int,
    ) -> None:
        self.sessions = sessions
        self.engine = engine
        self.registry = registry
        self.datasets = datasets
        self.judges = judges
        self.max_turns = max_turns

    # -- sessions -----------------------------------------------------------------------

    async def create(self, config: EnvSpec, owner: str) -> SessionView:
        await require(config.reward)
        parse_options(config.reward, config.reward_options)
        if by_model(config.reward):
            if config.kind == "tokens":
                raise invalid(
                    "reward",
                    "a tokens environment gives the reward model no text to read (use a chat or "
                    "text environment)",
                )
            if self.registry.not_ready_reason() is None:
                with worded({Role.MODEL: "reward"}):  # (else at the first step)
                    self.registry.get_reward("reward")
        if (judge := judge_of(config.reward)) is not None:
            self.judges.check(judge)
        self.engine.check_tools(config.tools)
        if config.max_turns is None:
            config = config.with_max_turns(self.max_turns)
        elif config.max_turns > self.max_turns:
            raise invalid(
                "max_turns",
                f"{config.max_turns} exceeds the server's limit of "
                f"{self.max_turns} (RLSERVE_ENVS__MAX_TURNS)",
            )
        if config.dataset is not None:
            await self._problems(config, owner, missing=invalid)
        kl_model = config.kl.model if config.kl is not None else None
        if kl_model is not None and self.registry.not_ready_reason() is None:
            with worded({Role.MODEL: "kl.model"}):  # (else at the first step)
                self.registry.get_pair(kl_model)
        return await self.sessions.create(config, owner)

    async def get(self, env_id: str, owner: str) -> SessionView:
        return await self.sessions.get(env_id, owner)

    async def delete(self, env_id: str, owner: str) -> None:
        await self.sessions.delete(env_id, owner)

    async def page(self, owner: str, offset: int, limit: int) -> tuple[list[SessionView], int]:
        return await self.sessions.page(owner, offset, limit)

    async def count(self) -> int:
        return await self.sessions.count()

    async def reap(self) -> int:
        return await self.sessions.reap()

    # -- episodes -----------------------------------------------------------------------

    async def reset(
        self, env_id: str, owner: str, prompts: Prompts = NO_PROMPTS
    ) -> list[Observation]:
        """New episodes from `prompts`; without any, the next prompts of the dataset."""
        preparer = self._preparer()
        async with self.sessions.opened(env_id, owner) as session:
            config = session.config
            problems = None
            if config.dataset is not None and not prompts.given:
                problems = await self._problems(config, owner, missing=_deleted)
            observations = await self.engine.reset(
                config, session.state, prompts, problems, preparer
            )
            session.forget_step()
        return observations

    async def step(
        self,
        env_id: str,
        owner: str,
        actions: list[Act | None],
        idempotency_key: str | None = None,
        *,
        sampler: str | None = None,
    ) -> StepResult:
        """Apply one action per running row, all or nothing. A step sent again with the
        idempotency key of the last applied step is answered as it was, not applied twice.
        `sampler`: the model that sampled the actions, when known (the KL penalty's default
        model)."""
        preparer = self._preparer()
        async with self.sessions.opened(env_id, owner) as session:
            answered = session.replayed(idempotency_key, actions)
            if answered is not None:
                return await self.engine.replay(session.config, session.state, answered, preparer)
            result = await self._step(
                env_id, session.config, session.state, actions, preparer, sampler
            )
            if idempotency_key is None:
                session.forget_step()
            else:  # kept without observations: the rows hold them (the session's size halves)
                session.remember(idempotency_key, actions, result.to_json(observations=False))
            return result

    async def _step(
        self,
        env_id: str,
        config: EnvSpec,
        state: EpisodeState,
        actions: list[Act | None],
        preparer: InputPreparer,
        sampler: str | None,
    ) -> StepResult:
        if config.kl is None and not runs_tools(config) and not scored_after(config):
            version = self.registry.policy_version
            return await self.engine.act_and_finish(
                env_id, version, config, state, actions, preparer
            )
        turns = await self.engine.act(env_id, config, state, actions, preparer)
        taken = [t for t in turns if t is not None]
        if by_model(config.reward):
            await self._reward_by_model(taken)
        elif (judge := judge_of(config.reward)) is not None:
            await self._reward_by_judge(judge, turns, config.repeats)
        version = await self._penalise_kl(config, taken, sampler)
        return await self.engine.finish(env_id, version, config, state, turns, preparer)

    async def _reward_by_model(self, turns: list[Turn]) -> None:
        """Every turn's reward from the served reward model, in one batched call: what
        `/v1/rewards` answers for the same conversation (or text). A turn longer than the
        reward model's context refuses the step (nothing applied), naming the row."""
        if not turns:
            return
        with worded({Role.MODEL: "reward"}):
            model = self.registry.get_reward("reward")

        def prepared(preparer: InputPreparer) -> list[Prepared]:
            return [
                Prepared(ids=preparer.encode(turn.read))
                if isinstance(turn.read, str)
                else preparer.template(turn.read or [], generation_prompt=False)
                for turn in turns
            ]

        _, scored = await model.read(prepared, "actions")
        for turn, values in zip(turns, scored, strict=True):
            turn.reward = values.reward[0]
            turn.breakdown = {**turn.breakdown, "task": turn.reward, "reward_model": turn.reward}

    async def _reward_by_judge(self, judge: str, turns: list[Turn | None], repeats: int) -> None:
        """Every taken turn's reward from the judge, in one batched call (group mode: one
        judge call per prompt's `repeats` rows); a turn the judge gave no score has reward
        None, the reason and the judge's text in its breakdown."""
        taken = [(row, turn) for row, turn in enumerate(turns) if turn is not None]
        groups: dict[tuple[int, str, str | None], int] = {}
        answers = []
        for row, turn in taken:
            sample = turn.sample or Sample(turn.action.text)  # (set for a judge's reward)
            prompt, answer = sample.prompt or "", sample.answer
            # (one prompt's repeats, as long as they still answer the same message)
            key = (row // max(repeats, 1), prompt, answer)
            group = groups.setdefault(key, len(groups))
            answers.append(Judged(prompt, sample.response, answer, group))
        verdicts = await self.judges.judge(judge, answers)
        for (_, turn), verdict in zip(taken, verdicts, strict=True):
            turn.reward = verdict.reward
            turn.breakdown = {**turn.breakdown, "task": verdict.reward, **verdict.info(judge)}

    async def _penalise_kl(self, config: EnvSpec, turns: list[Turn], sampler: str | None) -> int:
        """Score every action in one batched call under a read lease (tools ran before it, so
        they never hold up a weight update). Equal to `/v1/kl` with prompt_tokens and
        response_tokens on the same ids, for the KL's model (an adapter: against its base)."""
        if config.kl is None or not turns:
            return self.registry.policy_version
        adapter = sampler if sampler in self.registry.adapters else None
        with worded({Role.MODEL: "kl.model"}):
            pair = self.registry.get_pair(config.kl.model or adapter or "policy")
        async with self.registry.reading(pair.policy) as version:
            scored = await pair.score([t.action.full for t in turns])
        penalise_kl(config.kl, turns, scored)
        return self.registry.answered(pair.policy, version)

    def _preparer(self) -> InputPreparer:
        preparer: InputPreparer = self.registry.get("policy").preparer
        return preparer

    async def _problems(
        self, config: EnvSpec, owner: str, missing: Callable[[str, str], Exception]
    ) -> list[Problem]:
        """The session's dataset, every row checked for its reward; `missing` builds the
        failure when the dataset is gone (a 422 at creation, a 409 later)."""
        name = str(config.dataset)
        found = await self.datasets.rows_for(name, owner, config.reward)
        if found is None:
            have = await self.datasets.names(owner)
            raise missing("dataset", f"unknown dataset '{name}' (have {have})")
        problems, bad = found
        if bad is not None:
            index, field, what = bad
            raise invalid(
                "dataset",
                f"row {index + 1} of '{name}', field '{field}': {what} (reward '{config.reward}')",
            )
        return problems


def _deleted(param: str, message: str) -> Exception:
    return Conflict(
        f"{param}: {message}; it was deleted after this session was created", param=param
    )
