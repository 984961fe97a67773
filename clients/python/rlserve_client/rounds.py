"""One round of episodes: a batch of episodes in one environment session, reset from its
dataset, then, turn after turn, a generation for every live row and one step of all of them,
until every row is done.

The one implementation of the loop: `collect` drives it over HTTP, the server's
`/v1/rollouts` in-process. Seeded turns draw the same seeds (`turn_seed`), so both give the
same trajectories."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from rlserve_client.seeds import turn_seed

Obs = TypeVar("Obs")  # an observation
G = TypeVar("G")  # one row's generation
T = TypeVar("T")
Obs_co = TypeVar("Obs_co", covariant=True)


class Outcome(Protocol[Obs_co]):
    """What a step answers for one row."""

    @property
    def observation(self) -> Obs_co: ...

    @property
    def done(self) -> bool: ...


R = TypeVar("R", bound=Outcome)  # type: ignore[type-arg]


class Session(Protocol[Obs, G, R]):
    """The three calls a round makes of its environment session and its policy."""

    async def reset(self) -> list[Obs]:
        """New episodes; one observation per row."""

    async def generate(self, observations: list[Obs], seed: int | None) -> list[G]:
        """One generation per observation (the live rows'), sampled with `seed`."""

    async def step(self, actions: list[G | None]) -> list[R]:
        """Every row's outcome; a done row's action is None."""


@dataclass(frozen=True)
class Versioned(Generic[T]):
    """A row's generation and the policy version that sampled it."""

    value: T
    version: int


@dataclass(frozen=True)
class Turn(Generic[Obs, G, R]):
    observation: Obs
    """What the row's generation answered."""
    generation: G
    outcome: R


@dataclass(frozen=True)
class Round(Generic[Obs, G, R]):
    turns: list[list[Turn[Obs, G, R]]]
    """Per row, its turns in order."""
    last: list[Obs]
    """Per row, its last observation (the whole conversation)."""


async def play_round(session: Session[Obs, G, R], seed: int | None, index: int) -> Round[Obs, G, R]:
    """Round `index` of a run: turn t's generations are seeded with
    `turn_seed(seed, index, t)` when `seed` is given."""
    observations = await session.reset()
    turns: list[list[Turn[Obs, G, R]]] = [[] for _ in observations]
    live = list(range(len(observations)))
    turn = 0
    while live:
        turn_seed_ = None if seed is None else turn_seed(seed, index, turn)
        generated = await session.generate([observations[i] for i in live], turn_seed_)
        made = dict(zip(live, generated, strict=True))
        outcomes = await session.step([made.get(i) for i in range(len(observations))])
        for i, generation in made.items():
            turns[i].append(Turn(observations[i], generation, outcomes[i]))
            observations[i] = outcomes[i].observation
        live = [i for i in live if not outcomes[i].done]
        turn += 1
    return Round(turns, observations)
