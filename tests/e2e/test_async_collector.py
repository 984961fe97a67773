"""`AsyncCollector` against a real server process: batches sampled ahead of the trainer by at
most `max_staleness` versions, every token's version as the server recorded it, the decoupled
PPO weight of a stale token equal to the ratio of two independent forwards (the trainer's
weights over the weights that sampled it), and groups over the bound regenerated or dropped."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from rlserve_client import Client
from rlserve_client.async_collector import AsyncCollector, step_token_versions
from rlserve_client.offpolicy import decoupled_ppo_loss

from examples.grpo import response_log_probs, rollouts_of
from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import Server
from tests.e2e.trainer import learn, policy_server, trainer_model

ENV = {"dataset": "addition", "reward": "number", "repeats": 2, "max_turns": 1}
GENERATION = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with policy_server(tmp_path_factory.mktemp("async-collector")) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> Iterator[Client]:
    with Client(base_url=server.url, timeout=120) as c:
        yield c


def collector(client: Client, **options: object) -> AsyncCollector:
    return AsyncCollector(
        client,
        env=ENV,
        num_episodes=4,
        generation=GENERATION,
        seed=3,
        **options,  # type: ignore[arg-type]
    )


def test_one_step_off_weights_are_the_ratio_of_independent_forwards(client):
    model = trainer_model(client)
    start = client.weights_version().policy_version
    weights_at = {start: copy.deepcopy(model)}  # every version the server served
    stale_tokens = 0
    with client.weight_transfer() as sync, collector(client, max_staleness=1) as ahead:
        for k, batch in enumerate(ahead.batches(3)):
            assert batch.policy_version == start + k  # one push per batch
            assert all(s <= 1 for s in batch.staleness()) and len(batch.trajectories) == 4
            rollouts = rollouts_of(batch.trajectories)
            with torch.no_grad():
                proximal = response_log_probs(model, rollouts)
            rows = zip(batch.trajectories, rollouts, proximal, strict=True)
            for trajectory, rollout, prox in rows:
                (step,) = trajectory.steps
                versions = step_token_versions(step)
                assert len(versions) == len(rollout.response) == 5
                assert all(batch.policy_version - 1 <= v <= batch.policy_version for v in versions)
                full = rollout.prompt + rollout.response
                now = forward_log_probs(model, full)[len(rollout.prompt) :]
                expected_weights = []
                for t, version in enumerate(versions):
                    # the behaviour log-prob is the sampling version's (here: whole replies)
                    sampler = forward_log_probs(weights_at[version], full)[len(rollout.prompt) :]
                    assert_close([rollout.behaviour[t]], [sampler[t]], 1e-4)
                    expected_weights.append(torch.exp(torch.tensor(now[t] - sampler[t])).item())
                    stale_tokens += version < batch.policy_version
                out = decoupled_ppo_loss(
                    prox,
                    prox,
                    torch.tensor(rollout.behaviour),
                    torch.tensor(rollout.advantage),
                    torch.ones(len(prox), dtype=torch.bool),
                )
                assert_close(out.weights.tolist(), expected_weights, 2e-4)
            learn(model, seed=k)
            updated = sync.send(model)
            weights_at[updated.policy_version] = copy.deepcopy(model)
    assert stale_tokens > 0  # the second and third batches were sampled a version behind
    assert ahead.stats.dropped == ahead.stats.regenerated == 0
    assert ahead.stats.batches == 3 and ahead.stats.trajectories == 12


def test_max_staleness_0_is_synchronous(client):
    model = trainer_model(client)
    with client.weight_transfer() as sync, collector(client, max_staleness=0) as ahead:
        for k, batch in enumerate(ahead.batches(3)):
            for trajectory in batch.trajectories:
                (step,) = trajectory.steps
                assert set(step_token_versions(step)) == {batch.policy_version}
            learn(model, seed=10 + k)
            sync.send(model)
    assert ahead.stats.staleness == {0: 12}


@pytest.mark.parametrize("on_stale", ["regenerate", "drop"])
def test_groups_over_the_bound_are_regenerated_or_dropped(client, on_stale):
    """Two pushes after the first batch: the batch sampled beside it is two versions old when
    handed over. (The batches after it start after those pushes: within the bound.)"""
    model = trainer_model(client)
    with (
        client.weight_transfer() as sync,
        collector(client, max_staleness=1, on_stale=on_stale) as ahead,
    ):
        sizes = []
        for k, batch in enumerate(ahead.batches(3)):
            assert all(s <= 1 for s in batch.staleness())
            sizes.append(len(batch.trajectories))
            if on_stale == "regenerate" and k == 1:  # the new samples are the current version's
                assert batch.staleness() == [0] * 4 and batch.regenerated == 4
            for push in range(2 if k == 0 else 1):
                learn(model, seed=100 + 2 * k + push)
                sync.send(model)
    if on_stale == "regenerate":
        assert sizes == [4, 4, 4] and ahead.stats.regenerated == 4 and ahead.stats.dropped == 0
    else:
        assert sizes == [4, 0, 4] and ahead.stats.dropped == 4 and ahead.stats.regenerated == 0


def test_the_same_seed_draws_the_same_batches(client):
    """Batch j draws its prompts and samples with seed + j: two collectors with one seed hand
    over the same episodes (GRPO groups of `repeats` replies to one prompt)."""
    runs = []
    for _ in range(2):
        with collector(client, max_staleness=1) as ahead:
            batches = ahead.batches(2)
            runs.append([[t.steps[0].tokens.full for t in b.trajectories] for b in batches])
    assert runs[0] == runs[1]
    first, second = runs[0]
    assert first != second
    prompts = [tuple(full[: -GENERATION["max_new_tokens"]]) for full in first]  # type: ignore[index]
    assert prompts[0] == prompts[1] and prompts[2] == prompts[3]
