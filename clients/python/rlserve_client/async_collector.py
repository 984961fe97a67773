"""`AsyncCollector`: episodes generated while the trainer trains, never older than a bound.

    with client.weight_transfer() as sync, AsyncCollector(
        client, env=env, num_episodes=32, generation={"max_new_tokens": 64}, max_staleness=1
    ) as collector:
        for batch in collector.batches(steps):
            train_on(batch)              # batch.trajectories, batch.token_versions(...)
            sync.send(model)             # one push per batch: the version the bound counts

Each batch is one `/v1/rollouts` call (`num_episodes` episodes of `env`, GRPO groups with
their advantages when `repeats` > 1). Batch j starts generating as soon as the trainer has
asked for batch j - `max_staleness`: with 0 the loop is synchronous (a batch is sampled by the
weights it is trained from), with 1 the next batch is sampled while the trainer learns from
this one (one-step-off), and so on. A weight push during a batch's generation pauses the
server in 'keep' mode, so the episodes in flight go on under the new weights and every token
carries the version that sampled it (partial rollouts).

The bound is checked again when a batch is handed over, against the server's policy version
at that moment: a GRPO group with a token sampled more than `max_staleness` versions ago (a
trainer pushing more than once per batch, or another writer) is regenerated under the current
weights (`on_stale="regenerate"`, the default) or dropped (`"drop"`); `stats` counts both.
A group is the unit, since its advantages are normalised over all its members."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from rlserve_client._client import Client
from rlserve_client.seeds import turn_seed
from rlserve_client.types import RolloutResult, Step, Trajectory

OnStale = Literal["regenerate", "drop"]
MAX_REGENERATIONS = 8


def step_token_versions(step: Step) -> list[int]:
    """The policy version that sampled each response token of `step`."""
    versions = step.token_versions()
    if versions is not None:
        return versions
    return [step.policy_version] * len(step.tokens.response or [])


def oldest_version(trajectory: Trajectory) -> int:
    """The oldest policy version among the trajectory's sampled tokens."""
    versions = [v for step in trajectory.steps for v in step_token_versions(step)]
    return min(versions, default=min(step.policy_version for step in trajectory.steps))


@dataclass
class Batch:
    """What the trainer gets: complete episodes (with GRPO advantages), the server's policy
    version when they were handed over, and how long the trainer waited for them."""

    index: int
    trajectories: list[Trajectory]
    policy_version: int
    wait_s: float
    dropped: int = 0
    regenerated: int = 0

    def staleness(self) -> list[int]:
        """Per trajectory: how many versions behind the hand-over its oldest token is."""
        return [self.policy_version - oldest_version(t) for t in self.trajectories]


@dataclass
class CollectorStats:
    """Totals over the batches handed over so far."""

    batches: int = 0
    trajectories: int = 0
    dropped: int = 0
    regenerated: int = 0
    wait_s: float = 0.0
    staleness: dict[int, int] = field(default_factory=dict)
    """Trajectories by staleness (versions behind at hand-over)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "trajectories": self.trajectories,
            "dropped": self.dropped,
            "regenerated": self.regenerated,
            "wait_s": self.wait_s,
            "staleness": dict(sorted(self.staleness.items())),
        }


class AsyncCollector:
    """Batches of `/v1/rollouts` episodes generated ahead of the trainer by at most
    `max_staleness` policy versions (see the module docstring). `env`: the session config
    (`create_env` arguments with `dataset`, `max_turns` and, for GRPO, `repeats`);
    `generation`: sampling parameters; `seed`: batch j draws its prompts and samples with
    `seed` + j (a regeneration with a seed derived from both), so runs with the same seed see
    the same prompts."""

    def __init__(
        self,
        client: Client,
        *,
        env: dict[str, Any],
        num_episodes: int,
        generation: dict[str, Any] | None = None,
        max_staleness: int = 1,
        on_stale: OnStale = "regenerate",
        seed: int = 0,
        num_envs: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if on_stale not in ("regenerate", "drop"):
            raise ValueError(f"on_stale must be regenerate or drop, got {on_stale!r}")
        repeats = int(env.get("repeats") or 1)
        if num_episodes % repeats:
            raise ValueError(f"num_episodes ({num_episodes}) must be a multiple of repeats")
        self.client = client
        self.env = dict(env)
        self.num_episodes = num_episodes
        self.generation = dict(generation or {})
        self.max_staleness = max_staleness
        self.on_stale = on_stale
        self.seed = seed
        self.num_envs = num_envs
        self.repeats = repeats
        self.stats = CollectorStats()
        self._pool = ThreadPoolExecutor(max_workers=max_staleness + 1, thread_name_prefix="ahead")
        self._futures: dict[int, Future[RolloutResult]] = {}
        self._started = 0  # batches submitted
        self._next = 0  # the batch the trainer takes next
        self._lock = threading.Lock()
        self._closed = False

    # -- the trainer's side --------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    def batches(self, count: int) -> Iterator[Batch]:
        """The next `count` batches; nothing is generated past the last one's bound."""
        for _ in range(count):
            yield self.next_batch()

    def next_batch(self) -> Batch:
        """Wait for the next batch (asking for it tells the collector the trainer is done
        with the previous one), check its staleness and hand it over."""
        if self._closed:
            raise RuntimeError("the collector is closed")
        index = self._next
        self._fill(index)
        started = time.perf_counter()
        result = self._futures.pop(index).result()
        batch = self._checked(index, result.trajectories, self._version())
        batch.wait_s = time.perf_counter() - started
        self._next += 1
        self._record(batch)
        return batch

    # -- generation ------------------------------------------------------------------------

    def _fill(self, asked: int) -> None:
        """Start every batch up to `asked` + `max_staleness` not started yet."""
        with self._lock:
            while self._started <= asked + self.max_staleness:
                j = self._started
                self._futures[j] = self._pool.submit(self._rollouts, j, 0, self.num_episodes)
                self._started += 1

    def _version(self) -> int:
        """The version the server samples now: the policy's, or that of the LoRA adapter
        `generation` names as its `model`."""
        model = self.generation.get("model", "policy")
        if model != "policy":
            for adapter in self.client.adapters().adapters:
                if adapter.name == model:
                    return adapter.version
        return self.client.weights_version().policy_version

    def _rollouts(self, index: int, attempt: int, episodes: int) -> RolloutResult:
        seed = self.seed + index if attempt == 0 else turn_seed(self.seed, index, attempt)
        env = {**self.env, "batch_size": episodes, "seed": seed}
        generation = {**self.generation, "seed": seed}
        return self.client.rollouts(
            env=env, num_episodes=episodes, num_envs=self.num_envs, generation=generation
        )

    def _checked(self, index: int, trajectories: list[Trajectory], version: int) -> Batch:
        """The batch with its stale groups regenerated or dropped."""
        fresh, stale = self._split(trajectories, version)
        dropped = regenerated = 0
        attempt = 0
        while stale:
            if self.on_stale == "drop":
                dropped += len(stale)
                break
            attempt += 1
            if attempt > MAX_REGENERATIONS:
                raise RuntimeError(
                    f"batch {index}: still stale after {MAX_REGENERATIONS} regenerations "
                    "(is the policy version moving faster than one batch can be sampled?)"
                )
            regenerated += len(stale)
            again = self._rollouts(index, attempt, len(stale)).trajectories
            version = self._version()
            more, stale = self._split(again, version)
            fresh.extend(more)
        return Batch(index, fresh, version, 0.0, dropped=dropped, regenerated=regenerated)

    def _split(
        self, trajectories: list[Trajectory], version: int
    ) -> tuple[list[Trajectory], list[Trajectory]]:
        """(kept, stale): a group is stale when any of its tokens is over the bound."""
        groups: dict[Any, list[Trajectory]] = {}
        for i, t in enumerate(trajectories):
            key = (t.env_id, t.group) if t.group is not None else ("row", i)
            groups.setdefault(key, []).append(t)
        kept: list[Trajectory] = []
        stale: list[Trajectory] = []
        for members in groups.values():
            oldest = min(oldest_version(t) for t in members)
            (stale if version - oldest > self.max_staleness else kept).extend(members)
        return kept, stale

    def _record(self, batch: Batch) -> None:
        stats = self.stats
        stats.batches += 1
        stats.trajectories += len(batch.trajectories)
        stats.dropped += batch.dropped
        stats.regenerated += batch.regenerated
        stats.wait_s += batch.wait_s
        for s in batch.staleness():
            stats.staleness[s] = stats.staleness.get(s, 0) + 1

    # -- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop: batches not handed over are abandoned (their requests are left to finish)."""
        self._closed = True
        for future in self._futures.values():
            future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> AsyncCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
