"""`collect`: TorchRL `LLMCollector` semantics over HTTP. Environment sessions run
concurrently; each turn generates for all live rows of a session from the observations'
exact prompt tokens (no re-tokenization) and steps the session with the response tokens."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from rlserve_client._client import AsyncClient
from rlserve_client.advantages import (
    DEFAULT_TRAJECTORY_RETURN,
    TrajectoryReturn,
    assign_advantages,
    total,
)
from rlserve_client.progress import progress_bar
from rlserve_client.rounds import Turn, Versioned, play_round
from rlserve_client.sampling import check_generation_parameters
from rlserve_client.sequences import SequenceSplit
from rlserve_client.types import (
    LogProbs,
    Masks,
    Observation,
    RolloutResult,
    Sample,
    Step,
    StepOutput,
    Text,
    Tokens,
    Trajectory,
)


async def collect(
    client: AsyncClient,
    *,
    total_dialog_turns: int,
    env: dict[str, Any] | None = None,
    env_id: str | None = None,
    num_envs: int = 1,
    dialog_turns_per_batch: int | None = None,
    generation: dict[str, Any] | None = None,
    trajectory_return: TrajectoryReturn = DEFAULT_TRAJECTORY_RETURN,
    progress: bool | None = None,
) -> AsyncIterator[RolloutResult]:
    """Yield completed trajectories until at least `total_dialog_turns` steps are collected.

    `env`: a session config (the `create_env` arguments; `num_envs` sessions are created and
    deleted afterwards), or `env_id`: an existing session. Episodes draw prompts from the
    session's dataset and must end (`max_turns`). Without `dialog_turns_per_batch`, each
    session's finished batch of episodes is yielded as it completes (GRPO groups whole, with
    their advantages); with it, finished trajectories are held back until at least that many
    steps are ready (trajectories are never split). Rounds already running finish, so the
    total can exceed `total_dialog_turns` by what they add; a round starts only while the turns
    done plus one per running row stay below it. `generation`: the parameters of every
    turn's generation (`rlserve_client.sampling.GENERATION_PARAMETERS`, one sample a turn;
    `seed` makes the run reproducible, with the same trajectories as `/v1/rollouts` given the
    same seed). `trajectory_return`: what GRPO groups normalise, as in `/v1/rollouts` (sum,
    mean, max, last, or steps). Sessions it created are deleted when it finishes; to stop
    early, iterate inside `contextlib.aclosing(collect(...))` so that happens at once."""
    if (env is None) == (env_id is None):
        raise ValueError("give exactly one of env and env_id")
    generation = dict(generation or {})
    check_generation_parameters(generation, "generation")
    if {"n", "num_return_sequences"} & generation.keys():
        raise ValueError("generation: one sample a turn (an environment's repeats make groups)")
    config = env if env is not None else (await client.get_env(env_id or "")).config
    if config.get("max_turns") is None or config.get("dataset") is None:
        raise ValueError("collect needs an environment with a dataset and max_turns")
    repeats = int(config.get("repeats") or 1)
    async with _sessions(client, env, env_id, num_envs) as env_ids:
        runner = _Runner(client, generation, repeats, total_dialog_turns)
        runner.trajectory_return = trajectory_return
        with progress_bar(total=total_dialog_turns, enabled=progress, unit="turn") as bar:
            runner.on_turns = bar.update
            async for batch in runner.run(env_ids, dialog_turns_per_batch):
                yield batch


@contextlib.asynccontextmanager
async def _sessions(
    client: AsyncClient, env: dict[str, Any] | None, env_id: str | None, num_envs: int
) -> AsyncIterator[list[str]]:
    if env_id is not None:
        yield [env_id]
        return
    created: list[str] = []
    try:
        for _ in range(num_envs):
            created.append((await client.create_env(**(env or {}))).env_id)
        yield created
    finally:
        for session in created:
            with contextlib.suppress(Exception):
                await client.delete_env(session)


class _Runner:
    """Sessions as concurrent workers feeding a queue of finished rounds."""

    def __init__(
        self, client: AsyncClient, generation: dict[str, Any], repeats: int, total: int
    ) -> None:
        self.client = client
        self.generation = generation
        self.repeats = repeats
        self.total = total
        self.num_turns = 0
        self.num_live_rows = 0  # rows of running rounds: each will take at least one more turn
        self.num_rounds = 0
        self.num_groups = 0
        self.trajectory_return: TrajectoryReturn = DEFAULT_TRAJECTORY_RETURN
        self.pad_token_id: int | None = None
        self.on_turns: Any = lambda n: None

    async def run(
        self, env_ids: list[str], turns_per_batch: int | None
    ) -> AsyncIterator[RolloutResult]:
        finished: asyncio.Queue[list[Trajectory] | BaseException | None] = asyncio.Queue()
        workers = [asyncio.create_task(self._work(e, finished)) for e in env_ids]
        pending: list[Trajectory] = []
        try:
            for _ in workers:
                while (item := await finished.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    pending.extend(item)
                    ready = sum(len(t.steps) for t in pending)
                    if turns_per_batch is None or ready >= turns_per_batch:
                        yield await self._result(pending)
                        pending = []
            if pending:
                yield await self._result(pending)
        finally:
            for worker in workers:
                worker.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _work(
        self, env_id: str, finished: asyncio.Queue[list[Trajectory] | BaseException | None]
    ) -> None:
        try:
            while self.num_turns + self.num_live_rows < self.total:
                index = self.num_rounds
                self.num_rounds += 1
                trajectories = await self._round(env_id, index)
                self._group(trajectories)
                await finished.put(trajectories)
        except Exception as error:
            await finished.put(error)
        await finished.put(None)

    def _group(self, trajectories: list[Trajectory]) -> None:
        if self.repeats < 2:
            return
        assign_advantages(trajectories, self.repeats, self.trajectory_return, self.num_groups)
        self.num_groups += len(trajectories) // self.repeats

    async def _result(self, trajectories: list[Trajectory]) -> RolloutResult:
        version = (await self.client.weights_version()).policy_version
        return RolloutResult(
            trajectories=trajectories,
            num_dialog_turns=sum(len(t.steps) for t in trajectories),
            policy_version=version,
            pad_token_id=self.pad_token_id,
        )

    async def _round(self, env_id: str, index: int) -> list[Trajectory]:
        """Reset from the dataset, then generate and step until every row is done."""
        seed = self.generation.get("seed")
        played = await play_round(_RemoteSession(self, env_id), seed, index)
        return [
            Trajectory(
                env_id=env_id,
                row=row,
                steps=[_step(t) for t in row_turns],
                reward=total([t.outcome.reward for t in row_turns]),
                history=last.history,
            )
            for row, (row_turns, last) in enumerate(zip(played.turns, played.last, strict=True))
        ]


Made = Versioned[Sample]


class _RemoteSession:
    """A round's calls (`rounds.Session`) over HTTP, counted for the progress bar."""

    def __init__(self, collector: _Runner, env_id: str) -> None:
        self.collector = collector
        self.env_id = env_id

    async def reset(self) -> list[Observation]:
        observations = (await self.collector.client.reset_env(self.env_id)).observations
        self.collector.num_live_rows += len(observations)
        return observations

    async def generate(self, observations: list[Observation], seed: int | None) -> list[Made]:
        params = {k: v for k, v in self.collector.generation.items() if k != "seed"}
        if seed is not None:
            params["seed"] = seed
        tokens = [o.prompt_tokens for o in observations]
        client = self.collector.client
        generated = await client.generate(tokens=tokens, n=1, sticky=self.env_id, **params)
        self.collector.pad_token_id = generated.pad_token_id
        return [Made(sample, generated.policy_version) for sample in generated.samples]

    async def step(self, actions: list[Made | None]) -> list[StepOutput]:
        wire = [None if a is None else {"tokens": a.value.tokens.response or []} for a in actions]
        outputs = (await self.collector.client.step_env(self.env_id, actions=wire)).outputs
        stepped = [o for a, o in zip(actions, outputs, strict=True) if a is not None]
        collector = self.collector
        collector.num_live_rows -= sum(o.done for o in stepped)
        collector.num_turns += len(stepped)
        collector.on_turns(len(stepped))
        return outputs


def _step(turn: Turn[Observation, Made, StepOutput]) -> Step:
    sample, output = turn.generation.value, turn.outcome
    split = SequenceSplit.generated(sample.tokens.prompt or [], sample.tokens.response or [])
    tokens, masks = split.token_parts(), split.mask_parts()
    return Step(
        text=Text(response=sample.text.response if sample.text else None),
        tokens=Tokens(full=tokens.full, prompt=tokens.prompt, response=tokens.response),
        log_probs=LogProbs(response=sample.log_probs.response if sample.log_probs else []),
        masks=Masks(all_attention_mask=masks.attention, all_assistant_mask=masks.assistant),
        reward=output.reward,
        done=output.done,
        terminated=output.terminated,
        truncated=output.truncated,
        policy_version=turn.generation.version,
        policy_versions=sample.policy_versions,
        finish_reason=sample.finish_reason,
        info=output.info,
    )
