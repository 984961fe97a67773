"""Group advantages when a judge left some rewards out (None): those trajectories leave their
group, the rest are normalised among themselves, as if the group held only them."""

from __future__ import annotations

import statistics

import pytest
from rlserve_client.advantages import group_advantages, total


def normalised(values: list[float]) -> list[float]:
    mean = statistics.fmean(values)
    std = max(statistics.stdev(values), 1e-6) if len(values) > 1 else 1e-6
    return [(v - mean) / std for v in values]


def test_a_trajectory_without_a_reward_leaves_its_group() -> None:
    rewards: list[list[float | None]] = [[1.0], [None], [0.0], [0.5], [0.2], [0.4], [0.9], [0.1]]
    found = group_advantages(rewards, 4, "sum")
    assert found[1] == [None]
    assert [a[0] for a in (found[0], found[2], found[3])] == pytest.approx(
        normalised([1.0, 0.0, 0.5])
    )
    assert [a[0] for a in found[4:]] == pytest.approx(normalised([0.2, 0.4, 0.9, 0.1]))


def test_a_multi_step_trajectory_with_one_missing_reward_has_no_advantage_at_any_step() -> None:
    rewards: list[list[float | None]] = [[1.0, 0.5], [0.2, None], [0.0, 0.0], [0.3]]
    steps = group_advantages(rewards, 4, "steps")
    assert steps[1] == [None, None]
    flat = normalised([1.0, 0.5, 0.0, 0.0, 0.3])
    assert steps[0] + steps[2] + steps[3] == pytest.approx(flat)
    summed = group_advantages(rewards, 4, "sum")
    assert summed[1] == [None, None]
    expected = normalised([1.5, 0.0, 0.3])
    assert [summed[0][0], summed[2][0], summed[3][0]] == pytest.approx(expected)
    assert summed[0][0] == summed[0][1]


def test_a_group_with_one_or_no_rewards_left() -> None:
    assert group_advantages([[None], [2.0]], 2) == [[None], [0.0]]
    assert group_advantages([[None], [None]], 2) == [[None], [None]]


def test_a_total_is_none_once_a_step_has_no_reward() -> None:
    assert total([0.5, 0.25]) == 0.75
    assert total([0.5, None]) is None
    assert total([]) == 0
