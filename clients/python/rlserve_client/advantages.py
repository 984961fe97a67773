"""Group-normalised advantages (GRPO), with TorchRL `MCAdvantage`'s choices of return.

`trajectory_return`:
- "steps" (TorchRL's default, `trajectory_return=None`): every step reward of the group's
  trajectories is normalised together; each step gets its own advantage.
- "sum" (rlserve's default), "mean", "max" (TorchRL's options) and "last" (the final step's
  reward): each trajectory is reduced to one return, the returns are normalised across the
  group, and the trajectory's advantage is broadcast to its steps.

Normalisation is (x - mean) / std with the unbiased std clamped at 1e-6, as in TorchRL. For
single-turn episodes every choice gives the same advantages. The server's `/v1/rollouts`
imports this module too, so both paths give the same advantages.

A step without a reward (None: a judge gave no score) takes its trajectory out of its group:
the trajectory and its steps get no advantage, and the others are normalised among themselves
(a group left with one trajectory gives it 0)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal, Protocol

TrajectoryReturn = Literal["steps", "sum", "mean", "max", "last"]
DEFAULT_TRAJECTORY_RETURN: TrajectoryReturn = "sum"


def _normalise(values: list[float]) -> list[float]:
    mean = statistics.fmean(values)
    std = max(statistics.stdev(values), 1e-6) if len(values) > 1 else 1e-6
    return [(v - mean) / std for v in values]


def trajectory_return(rewards: list[float], how: TrajectoryReturn) -> float:
    if how == "mean":
        return statistics.fmean(rewards)
    if how == "max":
        return max(rewards)
    if how == "last":
        return rewards[-1]
    return sum(rewards)


def total(rewards: Sequence[float | None]) -> float | None:
    """The sum of a trajectory's step rewards; None when a step has none."""
    known = [r for r in rewards if r is not None]
    return sum(known) if len(known) == len(rewards) else None


def group_advantages(
    step_rewards: Sequence[Sequence[float | None]],
    group_size: int,
    how: TrajectoryReturn = DEFAULT_TRAJECTORY_RETURN,
) -> list[list[float | None]]:
    """Per trajectory, the advantage of each step, for consecutive groups of `group_size`
    (None for every step of a trajectory with a step without reward)."""
    if group_size < 2 or len(step_rewards) % group_size:
        raise ValueError(
            f"{len(step_rewards)} trajectories do not split into groups of {group_size}"
        )
    out: list[list[float | None]] = []
    for start in range(0, len(step_rewards), group_size):
        whole = step_rewards[start : start + group_size]
        scored = [all(r is not None for r in rewards) for rewards in whole]
        group = [[r for r in rewards if r is not None] for rewards in whole]
        group = [rewards for rewards, ok in zip(group, scored, strict=True) if ok]
        found = _advantages(group, how) if group else []
        out.extend(
            found.pop(0) if ok else [None] * len(rewards)
            for rewards, ok in zip(whole, scored, strict=True)
        )
    return out


def _advantages(group: list[list[float]], how: TrajectoryReturn) -> list[list[float | None]]:
    """One group's advantages, every trajectory with all its rewards."""
    out: list[list[float | None]] = []
    if how == "steps":
        flat = _normalise([r for rewards in group for r in rewards])
        for rewards in group:
            out.append(list(flat[: len(rewards)]))
            flat = flat[len(rewards) :]
    else:
        returns = _normalise([trajectory_return(rewards, how) for rewards in group])
        out.extend([a] * len(rewards) for a, rewards in zip(returns, group, strict=True))
    return out


class _Step(Protocol):
    reward: float | None
    advantage: float | None


class _Trajectory(Protocol):
    @property
    def steps(self) -> Sequence[_Step]: ...

    group: int | None
    advantage: float | None


def assign_advantages(
    trajectories: Sequence[_Trajectory],
    group_size: int,
    how: TrajectoryReturn = DEFAULT_TRAJECTORY_RETURN,
    first_group: int = 0,
) -> None:
    """Set the group ids (from `first_group` on) and advantages of consecutive groups of
    `group_size` trajectories, and of their steps: the trajectory's advantage is None when
    each step has its own ("steps")."""
    rewards = [[step.reward for step in t.steps] for t in trajectories]
    advantages = group_advantages(rewards, group_size, how)
    for i, (trajectory, values) in enumerate(zip(trajectories, advantages, strict=True)):
        trajectory.group = first_group + i // group_size
        trajectory.advantage = None if how == "steps" else values[0]
        for step, value in zip(trajectory.steps, values, strict=True):
            step.advantage = value
