"""Environment sessions: create, reset, step (tools, rewards, KL penalty), inspect, delete.
Steps on one session are serialised; every completed step is written to the store."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from app.common.failures import (
    Conflict,
    NotFound,
    NotReady,
    QuotaExceeded,
    Superseded,
    invalid,
)
from app.common.sequences import SequenceSplit
from app.config import Settings
from app.datasets.rows import Problem
from app.datasets.service import DatasetService
from app.engine.registry import ModelRegistry
from app.envs import episodes, ifeval  # noqa: F401 - ifeval registers its reward
from app.envs.protocol import (
    EnvConfig,
    EnvCreated,
    EnvList,
    EnvState,
    ResetRequest,
    ResetResponse,
    RowState,
    StepOutput,
    StepResponse,
)
from app.envs.rewards import Sample, first_bad_row, parse_options, require, score_reward
from app.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from app.envs.store import SessionRecord, SessionStore, now
from app.envs.tools import ToolBudget, run_python_blocks, tool_messages
from app.kl.estimators import per_token_kl

logger = logging.getLogger(__name__)


class EnvService:
    def __init__(
        self,
        store: SessionStore,
        registry: ModelRegistry,
        datasets: DatasetService,
        settings: Settings,
    ) -> None:
        self.store = store
        self.registry = registry
        self.datasets = datasets
        self.settings = settings
        limits = SandboxLimits(
            timeout_s=settings.tool_timeout_s,
            cpu_seconds=max(int(settings.tool_timeout_s), 1),
            memory_bytes=settings.tool_memory_mb << 20,
            max_output_bytes=settings.tool_max_output_bytes,
            max_processes=settings.tool_max_processes,
            tmpfs_bytes=settings.tool_tmpfs_mb << 20,
        )
        self.sandbox = Sandbox(
            limits,
            isolation=settings.tool_isolation,
            max_concurrent=settings.tool_max_concurrent,
            uid_base=settings.tool_uid_base,
        )
        self._locks: dict[str, asyncio.Lock] = {}

    # -- sessions -----------------------------------------------------------------------

    async def create(self, config: EnvConfig, owner: str) -> EnvCreated:
        await require(config.reward)
        parse_options(config.reward, config.reward_options)
        if "python" in config.tools and self.sandbox.problem is not None:
            raise invalid("tools", f"the python tool is disabled here: {self.sandbox.problem}")
        if config.max_turns is None:
            config = config.model_copy(update={"max_turns": self.settings.env_max_turns})
        elif config.max_turns > self.settings.env_max_turns:
            raise invalid(
                "max_turns",
                f"{config.max_turns} exceeds the server's limit of "
                f"{self.settings.env_max_turns} (RLSERVE_ENV_MAX_TURNS)",
            )
        if config.dataset is not None:
            await self._problems(config, owner, missing=invalid)
        if await self.store.count(owner) >= self.settings.max_env_sessions_per_key:
            raise QuotaExceeded(
                f"this API key has {self.settings.max_env_sessions_per_key} live environment "
                "sessions; delete one or wait for idle ones to expire"
            )
        if await self.store.count() >= self.settings.max_env_sessions:
            raise QuotaExceeded(
                f"{self.settings.max_env_sessions} environment sessions are live; delete one "
                "or wait for idle ones to expire"
            )
        env_id = f"env-{uuid.uuid4().hex}"
        stamp = now()
        state = episodes.EpisodeState().to_json()
        record = SessionRecord(env_id, config.model_dump(), state, stamp, stamp, owner)
        await self.store.put(record)
        return EnvCreated(env_id=env_id, config=config)

    async def _load(self, env_id: str, owner: str) -> SessionRecord:
        """The owner's session; another key's session is absent to this one (404 alike)."""
        record = await self.store.get(env_id)
        if record is not None and record.updated_at < now() - self.settings.env_ttl_s:
            await self._forget(env_id)
            record = None
        if record is None or not hmac.compare_digest(record.owner, owner):
            raise NotFound(f"environment '{env_id}' does not exist or expired")
        return record

    async def _forget(self, env_id: str) -> bool:
        self._locks.pop(env_id, None)
        return await self.store.delete(env_id)

    @contextlib.asynccontextmanager
    async def _session(
        self, env_id: str, owner: str
    ) -> AsyncIterator[tuple[SessionRecord, episodes.EpisodeState]]:
        """The session and its episodes under its lock; saved when the block completes
        without error (a failed step changes nothing). The save writes over the revision it
        read, so when another server changed the session meanwhile (two replicas sharing a
        store), this one's change is dropped: 409, and a retry with the same Idempotency-Key
        gets the step that was applied."""
        lock = self._locks.get(env_id)
        if lock is None:  # only sessions that exist get a lock (unknown ids leave nothing)
            await self._load(env_id, owner)
            lock = self._locks.setdefault(env_id, asyncio.Lock())
        async with lock:
            record = await self._load(env_id, owner)
            state = episodes.EpisodeState.from_json(record.state)
            yield record, state
            record.state = state.to_json()
            record.updated_at = now()
            if not await self.store.replace(record):
                raise Superseded(
                    f"environment '{env_id}' changed while this request ran (another server "
                    "applied a step); this one was not applied: send it again with the same "
                    "Idempotency-Key",
                    param="env_id",
                )

    async def get(self, env_id: str, owner: str) -> EnvState:
        return _state(await self._load(env_id, owner))

    async def delete(self, env_id: str, owner: str) -> None:
        await self._load(env_id, owner)
        await self._forget(env_id)

    async def page(self, owner: str, offset: int, limit: int) -> EnvList:
        records, total = await self.store.page(owner, offset, limit)
        return EnvList(envs=[_state(r) for r in records], total=total, offset=offset, limit=limit)

    async def reap(self) -> int:
        expired = await self.store.expire(now() - self.settings.env_ttl_s)
        for env_id in expired:
            self._locks.pop(env_id, None)
        return len(expired)

    # -- episodes -----------------------------------------------------------------------

    async def reset(self, env_id: str, owner: str, request: ResetRequest) -> ResetResponse:
        preparer = self.registry.get("policy").preparer
        async with self._session(env_id, owner) as (record, state):
            config = EnvConfig(**record.config)
            given_prompts = _gives_prompts(request)
            if given_prompts:
                given = request.fields or [{}] * config.batch_size
                bad = first_bad_row(config.reward, given)
                if bad is not None:
                    index, field, what = bad
                    raise invalid(f"fields[{index}].{field}", f"{what} (reward '{config.reward}')")
            problems = None
            if config.dataset is not None and not given_prompts:
                problems = await self._problems(config, owner, missing=_deleted)
            episodes.reset(config, state, request, preparer, problems)
            state.last_step = None
            observations = [episodes.observation(config, row, preparer) for row in state.rows]
        return ResetResponse(env_id=env_id, observations=observations)

    async def _problems(
        self, config: EnvConfig, owner: str, missing: Callable[[str, str], Exception]
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

    async def step(
        self,
        env_id: str,
        owner: str,
        actions: list[episodes.Act | None],
        idempotency_key: str | None = None,
    ) -> StepResponse:
        """Apply one action per running row, all or nothing. A step sent again with the
        idempotency key of the last applied step is answered as it was, not applied twice."""
        preparer = self.registry.get("policy").preparer
        digest = None if idempotency_key is None else _digest(actions)
        async with self._session(env_id, owner) as (record, state):
            last = state.last_step
            if digest is not None and last is not None and last["key"] == idempotency_key:
                if last["digest"] != digest:
                    raise invalid(
                        "Idempotency-Key",
                        "was used for a step with other actions; use a new key per step",
                    )
                return StepResponse.model_validate(last["response"])
            response = await self._step(
                env_id, EnvConfig(**record.config), state, actions, preparer
            )
            state.last_step = None
            if digest is not None:
                state.last_step = {
                    "key": idempotency_key,
                    "digest": digest,
                    "response": response.model_dump(mode="json"),
                }
            return response

    async def _step(
        self,
        env_id: str,
        config: EnvConfig,
        state: episodes.EpisodeState,
        actions: list[episodes.Act | None],
        preparer: Any,
    ) -> StepResponse:
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
        acts = [
            None if action is None else _fitting_action(row, action, preparer, i)
            for i, (row, action) in enumerate(zip(rows, actions, strict=True))
        ]
        budget = ToolBudget(
            deadline=asyncio.get_running_loop().time() + self.settings.tool_step_budget_s,
            max_blocks=self.settings.tool_max_blocks,
        )
        turns = await asyncio.gather(
            *(
                self._act(config, row, act, preparer, budget)
                for row, act in zip(rows, acts, strict=True)
            )
        )
        version = await self._penalise_kl(config, [t for t in turns if t is not None])
        outputs = []
        for row, turn in zip(rows, turns, strict=True):
            if turn is None:  # a finished row stays as it is
                outputs.append(_output(config, row, preparer, 0.0, {}))
                continue
            turn.info["reward"] = turn.breakdown
            episodes.finish_turn(
                config, row, turn.reward, turn.ends_episode, preparer.max_model_len
            )
            outputs.append(_output(config, row, preparer, turn.reward, turn.info))
        return StepResponse(env_id=env_id, policy_version=version, outputs=list(outputs))

    async def _act(
        self,
        config: EnvConfig,
        row: episodes.Row,
        act: episodes.ActionTokens | None,
        preparer: Any,
        budget: ToolBudget,
    ) -> Turn | None:
        """Apply one row's action, run its tools and score it (without the KL penalty)."""
        if act is None:
            return None
        info: dict[str, object] = {}
        following: list[dict[str, str]] = []
        if "python" in config.tools:
            try:
                results = await run_python_blocks(act.text, self.sandbox, budget)
            except SandboxUnavailable as error:
                raise NotReady(f"the python tool is disabled here: {error}") from error
            if results:
                following = tool_messages(results)
                info["tool_results"] = [r.model_dump() for r in results]
        prompt = row.history[-1]["content"] if row.history else row.text
        episodes.apply_action(config, row, act, preparer, following)
        sample = Sample(act.text, row.answer, prompt, row.fields)
        result = score_reward(config.reward, config.reward_options, sample)
        if row.answer is not None and config.reward != "none":
            info["answer"] = row.answer
        return Turn(
            action=act,
            reward=result.reward,
            ends_episode=result.ends_episode,
            breakdown={"task": result.reward, **result.info},
            info=info,
        )

    async def _penalise_kl(self, config: EnvConfig, turns: list[Turn]) -> int:
        """Subtract coeff * KL(policy||reference) over exactly the tokens of each action, in one
        batched call under a read lease (tools ran before it, so they never hold up a weight
        update). Equal to `/v1/kl` with prompt_tokens/response_tokens on the same ids."""
        if config.kl is None or not turns:
            return self.registry.policy_version
        async with self.registry.reading() as version:
            scored = await self.registry.get_pair().score([t.action.full for t in turns])
        for turn, (policy, reference) in zip(turns, scored, strict=True):
            mask = SequenceSplit.generated(turn.action.prompt, turn.action.ids).counted()
            kl = sum(per_token_kl(policy, reference, mask, config.kl.estimator))
            turn.reward -= config.kl.coeff * kl
            turn.breakdown |= {"kl": kl, "kl_penalty": -config.kl.coeff * kl}
        return version


def _gives_prompts(request: ResetRequest) -> bool:
    return any(p is not None for p in (request.query, request.messages, request.tokens))


def _deleted(param: str, message: str) -> Exception:
    return Conflict(
        f"{param}: {message}; it was deleted after this session was created", param=param
    )


def _digest(actions: list[episodes.Act | None]) -> str:
    """A step's actions, hashed: a retried step must carry the same ones."""
    plain = [None if a is None else [a.text, a.tokens] for a in actions]
    return hashlib.sha256(json.dumps(plain).encode()).hexdigest()


def _fitting_action(
    row: episodes.Row, action: episodes.Act, preparer: Any, index: int
) -> episodes.ActionTokens:
    """The row's action as tokens, refused (422, before any row changes) when history plus
    action exceed the model's maximum length: no policy could have produced it, and a
    history past that length could only be scored by truncating it. A text far too long is
    refused before it is encoded, so step cost stays bounded by max_model_len."""
    room = preparer.max_model_len - len(row.ids)
    field = f"actions[{index}]"
    message = (
        f"row {index}'s history ({len(row.ids)} tokens) plus this action exceed the model's "
        f"maximum length of {preparer.max_model_len}; reset the episode"
    )
    if action.text is not None and preparer.certainly_longer(action.text, room):
        raise invalid(field, message)
    act = episodes.action_tokens(row, action, preparer)
    if len(act.ids) > room:
        raise invalid(field, message)
    return act


@dataclass
class Turn:
    """One row's step before its episode flags are updated."""

    action: episodes.ActionTokens
    reward: float
    ends_episode: bool
    breakdown: dict[str, object]
    info: dict[str, object]


def _output(
    config: EnvConfig, row: episodes.Row, preparer: Any, reward: float, info: dict[str, object]
) -> StepOutput:
    return StepOutput(
        observation=episodes.observation(config, row, preparer),
        reward=reward,
        done=row.done,
        terminated=row.terminated,
        truncated=row.truncated,
        info=info,
    )


def _state(record: SessionRecord) -> EnvState:
    state = episodes.EpisodeState.from_json(record.state)
    rows = [
        RowState(
            turns=r.turns,
            done=r.done,
            terminated=r.terminated,
            truncated=r.truncated,
            total_reward=r.total_reward,
        )
        for r in state.rows
    ]
    return EnvState(
        env_id=record.env_id,
        config=EnvConfig(**record.config),
        started=state.started,
        rows=rows,
        created_at=record.created_at,
        updated_at=record.updated_at,
    )
