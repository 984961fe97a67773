"""Server-side rollouts: the round loop of `collect` (`rlserve_client.rounds`), without a round
trip per turn."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeAlias

from rlserve_client.advantages import assign_advantages
from rlserve_client.rounds import Turn, Versioned, play_round

from app.common.failures import invalid, worded
from app.common.inputs import InputPreparer
from app.common.roles import Role
from app.common.sampling import GenerationAsk, Names
from app.common.service import Resolved
from app.engine.types import Generation
from app.envs.engine import RowOutcome
from app.envs.episodes import Act, Observation
from app.envs.service import EnvService
from app.envs.spec import EnvSpec
from app.generation.service import GenerationService
from app.rollouts.protocol import (
    RolloutGeneration,
    RolloutRequest,
    RolloutResponse,
    RolloutStep,
    Trajectory,
)

NAMES = Names("generation.")
"""A rollout's sampling fields, as its refusals name them."""


class RolloutService:
    def __init__(
        self, envs: EnvService, generation: GenerationService, *, max_rollout_turns: int
    ) -> None:
        self.envs = envs
        self.generation = generation
        self.max_rollout_turns = max_rollout_turns

    async def run(self, request: RolloutRequest, owner: str) -> RolloutResponse:
        """Episodes in the caller's session (`env_id`) or in temporary sessions it owns."""
        if request.env is not None:
            config = request.env.to_spec()
        else:
            config = (await self.envs.get(request.env_id or "", owner)).config
        limit = self.max_rollout_turns
        _check(config, request.num_episodes, limit, given_env=request.env is not None)
        registry = self.envs.registry
        if registry.not_ready_reason() is None:  # (a model still loading is answered later)
            with worded({Role.MODEL: "generation.model"}):
                registry.get(request.generation.model)
            self._sampling(request.generation)  # refused now, before any episode starts
            if config.kl is not None and config.kl.model is not None:
                where = "env.kl.model" if request.env is not None else "env_id"
                with worded({Role.MODEL: where}):
                    registry.get_pair(config.kl.model)
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
            policy_version=registry.version_of(registry.get(request.generation.model)),
            pad_token_id=self.envs.registry.get("policy").preparer.pad_token_id,
        )

    @contextlib.asynccontextmanager
    async def _sessions(
        self, request: RolloutRequest, owner: str, config: EnvSpec, num_rounds: int
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

    def _sampling(self, generation: RolloutGeneration) -> Resolved:
        ask = GenerationAsk(generation.sampling_ask())
        return self.generation.resolve(ask, generation.model, NAMES)

    async def _round(
        self,
        env_id: str,
        owner: str,
        config: EnvSpec,
        generation: RolloutGeneration,
        index: int,
    ) -> list[Trajectory]:
        """One batch of episodes in one session (the loop `collect` runs too)."""
        sampling = self._sampling(generation)
        session = _PolicySession(self, env_id, owner, sampling, generation.model)
        played = await play_round(session, generation.seed, index)
        preparer = self.envs.registry.get("policy").preparer
        texts = iter(await preparer.off_loop(_responses, preparer, played.turns))
        return [
            Trajectory.of(env_id, row, [_step(t, next(texts)) for t in row_turns], last.history)
            for row, (row_turns, last) in enumerate(zip(played.turns, played.last, strict=True))
        ]


Made: TypeAlias = Versioned[Generation]


class _PolicySession:
    """A round's calls (`rlserve_client.rounds.Session`) on this server's services."""

    def __init__(
        self,
        service: RolloutService,
        env_id: str,
        owner: str,
        sampling: Resolved,
        model: str,
    ) -> None:
        self.service = service
        self.env_id = env_id
        self.owner = owner
        self.sampling = sampling
        self.model = model

    async def reset(self) -> list[Observation]:
        return await self.service.envs.reset(self.env_id, self.owner)

    async def generate(self, observations: list[Observation], seed: int | None) -> list[Made]:
        prompts = [o.prompt_tokens for o in observations]
        sampled = await self.service.generation.sample_tokens(
            prompts, self.sampling, seed=seed, model=self.model
        )
        return [Versioned(g, sampled.version) for g in sampled.generations]

    async def step(self, actions: list[Made | None]) -> list[RowOutcome]:
        acts = [None if a is None else Act(tokens=a.value.token_ids) for a in actions]
        stepped = await self.service.envs.step(self.env_id, self.owner, acts, sampler=self.model)
        return stepped.outputs


def _check(config: EnvSpec, num_episodes: int, max_turns: int, *, given_env: bool) -> None:
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


PlayedTurn: TypeAlias = Turn[Observation, Made, RowOutcome]


def _step(turn: PlayedTurn, response_text: str) -> RolloutStep:
    made = turn.generation
    prompt = turn.observation.prompt_tokens
    return RolloutStep.of(prompt, made.value, response_text, made.version, turn.outcome)


def _responses(preparer: InputPreparer, turns: list[list[PlayedTurn]]) -> list[str]:
    """Every turn's generated text, row by row (on the tokenizer thread)."""
    return [preparer.decode(t.generation.value.token_ids) for row in turns for t in row]
