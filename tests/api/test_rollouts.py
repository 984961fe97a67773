"""`POST /v1/rollouts`: whole episodes on the server, checked against an independent forward
and an independent (torch) computation of the group advantages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from app.envs.rewards import REWARDS, RewardResult, Sample, register_reward
from tests.conftest import assert_close

ENV = {"dataset": "arithmetic", "reward": "byte_sum", "batch_size": 4, "max_turns": 2}
GENERATION = {"max_new_tokens": 6, "seed": 11}


@pytest.fixture(autouse=True)
def byte_sum_reward() -> Iterator[None]:
    """A reward that varies with the sampled text, so group statistics are not trivial."""

    @register_reward("byte_sum")
    def byte_sum(sample: Sample) -> RewardResult:
        return RewardResult(float(sum(sample.response.encode()) % 5))

    yield
    REWARDS.pop("byte_sum")


async def rollouts(client, status: int = 200, **body: object) -> dict:  # type: ignore[no-untyped-def,type-arg]
    response = await client.post("/v1/rollouts", json=body)
    assert response.status_code == status, response.text
    return response.json()


async def test_episodes_run_to_the_end_with_exact_tokens_and_log_probs(client, reference_log_probs):
    before = (await client.get("/v1/envs")).json()["total"]
    out = await rollouts(client, env=ENV, num_episodes=8, num_envs=2, generation=GENERATION)
    trajectories = out["trajectories"]
    assert len(trajectories) == 8
    assert out["num_dialog_turns"] == sum(len(t["steps"]) for t in trajectories) == 16
    for trajectory in trajectories:
        steps = trajectory["steps"]
        assert [s["truncated"] for s in steps] == [False, True]
        assert [s["done"] for s in steps] == [False, True]
        assert trajectory["reward"] == pytest.approx(sum(s["reward"] for s in steps))
        assert "advantage" not in trajectory and "group" not in trajectory
        for step in steps:
            tokens, masks = step["tokens"], step["masks"]
            assert tokens["full"] == tokens["prompt"] + tokens["response"]
            num_prompt, num_response = len(tokens["prompt"]), len(tokens["response"])
            assert masks["all_assistant_mask"] == [0] * num_prompt + [1] * num_response
            assert masks["all_attention_mask"] == [1] * (num_prompt + num_response)
            expected = reference_log_probs(tokens["full"])[num_prompt:]
            assert_close(step["log_probs"]["response"], expected, 1e-4)
        # the second turn's prompt continues the first turn's conversation
        assert (
            steps[1]["tokens"]["prompt"][: len(steps[0]["tokens"]["prompt"])]
            == (steps[0]["tokens"]["prompt"])
        )
        assert [m["role"] for m in trajectory["history"]] == ["user", "assistant", "assistant"]
        replies = [m["content"] for m in trajectory["history"][1:]]  # what the env rewarded
        assert [s["reward"] for s in steps] == [float(sum(r.encode()) % 5) for r in replies]
    assert (await client.get("/v1/envs")).json()["total"] == before  # temporary sessions gone


async def test_grpo_groups_get_mc_advantages(client):
    env = {**ENV, "repeats": 4, "batch_size": 8, "max_turns": 1}
    out = await rollouts(client, env=env, num_episodes=16, generation={"max_new_tokens": 8})
    trajectories = out["trajectories"]
    assert [t["group"] for t in trajectories] == [i // 4 for i in range(16)]
    rewards = torch.tensor([t["reward"] for t in trajectories], dtype=torch.float64).view(4, 4)
    mean, std = rewards.mean(1, keepdim=True), rewards.std(1, keepdim=True).clamp_min(1e-6)
    expected = ((rewards - mean) / std).flatten().tolist()
    assert_close([t["advantage"] for t in trajectories], expected, 1e-9)
    assert [s["advantage"] for t in trajectories for s in t["steps"]] == [
        t["advantage"] for t in trajectories
    ]
    assert rewards.std(1).max() > 0  # the check above is not all zeros
    for group in range(4):  # a group shares its prompt
        prompts = {tuple(t["steps"][0]["tokens"]["prompt"]) for t in trajectories[group * 4 :][:4]}
        assert len(prompts) == 1


async def test_a_seed_makes_rollouts_reproducible(client):
    first = await rollouts(client, env={**ENV, "seed": 3}, num_episodes=4, generation=GENERATION)
    again = await rollouts(client, env={**ENV, "seed": 3}, num_episodes=4, generation=GENERATION)

    def responses(out: dict) -> list[list[int]]:  # type: ignore[type-arg]
        return [s["tokens"]["response"] for t in out["trajectories"] for s in t["steps"]]

    assert responses(first) == responses(again)
    assert len({tuple(r) for r in responses(first)}) > 1


async def test_an_existing_session_runs_the_episodes_and_stays(client):
    created = await client.post("/v1/envs", json=ENV)
    env_id = created.json()["env_id"]
    out = await rollouts(client, env_id=env_id, num_episodes=8, generation=GENERATION)
    assert {t["env_id"] for t in out["trajectories"]} == {env_id}
    state = (await client.get(f"/v1/envs/{env_id}")).json()
    assert all(row["done"] for row in state["rows"])
    assert (await client.delete(f"/v1/envs/{env_id}")).status_code == 204


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"env": ENV, "env_id": "env-x", "num_episodes": 4}, 422, "env"),
        ({"num_episodes": 4}, 422, "env"),
        ({"env": {**ENV, "dataset": None}, "num_episodes": 4}, 422, "env.dataset"),
        ({"env": {**ENV, "max_turns": None}, "num_episodes": 4}, 422, "env.max_turns"),
        ({"env": ENV, "num_episodes": 6}, 422, "num_episodes"),
        ({"env": ENV, "num_episodes": 0}, 422, "num_episodes"),
        ({"env": ENV, "num_episodes": 4, "generation": {"top_p": 2}}, 422, "generation.top_p"),
        ({"env_id": "env-missing", "num_episodes": 4}, 404, None),
        ({"env_id": "env-missing", "num_episodes": 4, "num_envs": 2}, 422, "num_envs"),
    ],
)
async def test_bad_rollout_requests_name_the_field(client, body, status, param):
    error = (await rollouts(client, status=status, **body))["error"]
    assert error["param"] == param


def torch_advantages(rewards: list[list[float]], group_size: int, how: str) -> list[list[float]]:
    """TorchRL MCAdvantage's arithmetic, written with torch: per-step over the group's steps
    ("steps"), or one reduced return per trajectory broadcast to its steps."""
    out: list[list[float]] = []
    for start in range(0, len(rewards), group_size):
        group = [torch.tensor(r, dtype=torch.float64) for r in rewards[start : start + group_size]]
        if how == "steps":
            flat = torch.cat(group)
            normed = ((flat - flat.mean()) / flat.std().clamp_min(1e-6)).split(
                [len(g) for g in group]
            )
            out.extend(n.tolist() for n in normed)
            continue
        reduce = {"sum": torch.sum, "mean": torch.mean, "max": torch.max, "last": lambda g: g[-1]}
        returns = torch.stack([reduce[how](g) for g in group])
        advantage = (returns - returns.mean()) / returns.std().clamp_min(1e-6)
        out.extend([float(a)] * len(g) for a, g in zip(advantage, group, strict=True))
    return out


@pytest.mark.parametrize("how", ["steps", "sum", "mean", "max", "last"])
async def test_multi_turn_advantages_follow_the_chosen_return(client, how):
    env = {**ENV, "repeats": 4, "batch_size": 4, "max_turns": 3}
    out = await rollouts(
        client, env=env, num_episodes=8, generation={**GENERATION, "seed": 5}, trajectory_return=how
    )
    rewards = [[s["reward"] for s in t["steps"]] for t in out["trajectories"]]
    assert all(len(r) == 3 for r in rewards)
    expected = torch_advantages(rewards, 4, how)
    got = [[s["advantage"] for s in t["steps"]] for t in out["trajectories"]]
    for mine, theirs in zip(got, expected, strict=True):
        assert_close(mine, theirs, 1e-9)
    if how == "steps":
        assert all("advantage" not in t for t in out["trajectories"])
    else:
        assert [t["advantage"] for t in out["trajectories"]] == [g[0] for g in got]
    assert any(len(set(g)) > 1 for g in got) or how != "steps"  # steps differ within a trajectory
