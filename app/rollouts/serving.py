"""Server-side rollouts: the generate -> step loop of `collect`, without a round trip per turn."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from rlserve_client.advantages import TrajectoryReturn, group_advantages
from rlserve_client.seeds import turn_seed

from app.common.failures import invalid
from app.common.inputs import InputPreparer
from app.common.protocol import TextFields, wire_spans
from app.common.sequences import SequenceSplit
from app.engine.types import Generation
from app.envs.episodes import Act
from app.envs.protocol import EnvConfig, ResetRequest, StepOutput
from app.envs.service import EnvService
from app.generation.serving import GenerationService
from app.rollouts.protocol import (
    RolloutGeneration,
    RolloutRequest,
    RolloutResponse,
    RolloutStep,
    Trajectory,
)


class RolloutService:
    def __init__(self, envs: EnvService, generation: GenerationService) -> None:
        self.envs = envs
        self.generation = generation

    async def run(self, request: RolloutRequest, owner: str) -> RolloutResponse:
        """Episodes in the caller's session (`env_id`) or in temporary sessions it owns."""
        config = request.env or (await self.envs.get(request.env_id or "", owner)).config
        limit = self.generation.settings.max_rollout_turns
        _check(config, request.num_episodes, limit, given_env=request.env is not None)
        num_rounds = request.num_episodes // config.batch_size
        rounds = iter(range(num_rounds))  # shared: each session takes the next round it can
        results: dict[int, list[Trajectory]] = {}

        async def worker(env_id: str) -> None:
            for index in rounds:
                results[index] = await self._round(env_id, owner, config, request.generation, index)

        async with self._sessions(request, owner, config, num_rounds) as env_ids:
            await asyncio.gather(*(worker(env_id) for env_id in env_ids))
        trajectories = [t for index in sorted(results) for t in results[index]]
        if config.repeats > 1:
            assign_advantages(trajectories, config.repeats, request.trajectory_return)
        return RolloutResponse(
            trajectories=trajectories,
            num_dialog_turns=sum(len(t.steps) for t in trajectories),
            policy_version=self.envs.registry.policy_version,
            pad_token_id=self.envs.registry.get("policy").preparer.pad_token_id,
        )

    @contextlib.asynccontextmanager
    async def _sessions(
        self, request: RolloutRequest, owner: str, config: EnvConfig, num_rounds: int
    ) -> AsyncIterator[list[str]]:
        """The existing session, or temporary ones deleted afterwards (also on failure)."""
        if request.env_id is not None:
            yield [request.env_id]
            return
        created: list[str] = []
        try:
            for _ in range(min(request.num_envs, num_rounds)):
                created.append((await self.envs.create(config, owner)).env_id)
            yield created
        finally:
            for env_id in created:
                with contextlib.suppress(Exception):
                    await self.envs.delete(env_id, owner)

    async def _round(
        self,
        env_id: str,
        owner: str,
        config: EnvConfig,
        generation: RolloutGeneration,
        index: int,
    ) -> list[Trajectory]:
        """One batch of episodes in one session: reset from the dataset, then turns until
        every row is done."""
        observations = (await self.envs.reset(env_id, owner, ResetRequest())).observations
        steps: list[list[RolloutStep]] = [[] for _ in observations]
        live = list(range(len(observations)))
        sampling = generation.to_sampling_config(
            self.generation.max_new_tokens(generation.max_new_tokens, "generation.max_new_tokens")
        )
        preparer = self.envs.registry.get("policy").preparer
        turn = 0
        while live:
            seed = None if generation.seed is None else turn_seed(generation.seed, index, turn)
            prompts = [observations[i].prompt_tokens for i in live]
            sampled = await self.generation.sample_tokens(prompts, sampling, seed=seed)
            made = dict(zip(live, sampled.generations, strict=True))
            actions = [
                Act(tokens=made[i].token_ids) if i in made else None
                for i in range(len(observations))
            ]
            stepped = await self.envs.step(env_id, owner, actions)
            for i, made_i in made.items():
                output = stepped.outputs[i]
                prompt = observations[i].prompt_tokens
                steps[i].append(_step(prompt, made_i, output, sampled.version, preparer))
                observations[i] = output.observation
            live = [i for i in live if not stepped.outputs[i].done]
            turn += 1
        return [
            Trajectory(
                env_id=env_id,
                row=row,
                steps=row_steps,
                reward=sum(s.reward for s in row_steps),
                history=observations[row].history,
            )
            for row, row_steps in enumerate(steps)
        ]


def assign_advantages(
    trajectories: list[Trajectory], group_size: int, how: TrajectoryReturn
) -> None:
    """Group ids and advantages of consecutive groups of `group_size` trajectories."""
    rewards = [[step.reward for step in t.steps] for t in trajectories]
    advantages = group_advantages(rewards, group_size, how)
    for i, (trajectory, values) in enumerate(zip(trajectories, advantages, strict=True)):
        trajectory.group = i // group_size
        trajectory.advantage = None if how == "steps" else values[0]
        for step, value in zip(trajectory.steps, values, strict=True):
            step.advantage = value


def _check(config: EnvConfig, num_episodes: int, max_turns: int, *, given_env: bool) -> None:
    def where(name: str) -> str:
        return f"env.{name}" if given_env else "env_id"

    if config.dataset is None:
        raise invalid(where("dataset"), "rollouts draw prompts from a dataset; there is none")
    if config.max_turns is None:
        raise invalid(where("max_turns"), "rollouts need episodes that end: set max_turns")
    if num_episodes % config.batch_size:
        raise invalid(
            "num_episodes",
            f"{num_episodes} is not a multiple of the environment's batch_size "
            f"({config.batch_size})",
        )
    if num_episodes * config.max_turns > max_turns:
        raise invalid(
            "num_episodes",
            f"{num_episodes} episodes of up to {config.max_turns} turns exceed the server's "
            f"limit of {max_turns} turns per request",
        )


def _step(
    prompt: list[int],
    generation: Generation,
    output: StepOutput,
    version: int,
    preparer: InputPreparer,
) -> RolloutStep:
    split = SequenceSplit.generated(prompt, generation.token_ids)
    return RolloutStep(
        text=TextFields(response=preparer.decode(generation.token_ids)),
        tokens=split.tokens(),
        log_probs=split.log_probs(response=generation.log_probs),
        masks=split.masks(),
        reward=output.reward,
        done=output.done,
        terminated=output.terminated,
        truncated=output.truncated,
        policy_version=version,
        policy_versions=wire_spans(generation.versions),
        finish_reason=generation.finish_reason,
        info=output.info,
    )
