"""Deltas on a deployment of several replicas: each replica rebuilds the delta from its own
weights and checks it, and all commit it or none does; a replica that starts later catches up
along the ledger's chain (or from the whole checkpoint that replaced it) before it serves, and
refuses a request pinned to a version it does not hold yet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from rlserve_client.weight_delta import DeltaEncoder, weights_digest

from app.common.failures import Conflict, VersionBehind
from app.engine import pins
from app.updates.service import WeightsService
from app.updates.types import Publish
from tests.deploy.test_replicated_weights import BASE, Cluster, body


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(tmp_path, num_replicas=2, chunk_bytes=1 << 20)
    yield made
    for replica in made.replicas:
        await replica.weights.aclose()


def steps(count: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's weights after each of `count` steps (one element of `w` moves a step)."""
    states, state = [], {k: v.clone() for k, v in BASE.items()}
    for step in range(count):
        state = {k: v.clone() for k, v in state.items()}
        state["w"][step % 4] += 0.5
        states.append(state)
    return states


async def push_deltas(cluster: Cluster, states: list[dict[str, torch.Tensor]]) -> None:
    encoder = DeltaEncoder()
    encoder.remember(BASE, 0, weights_digest(BASE))
    for state in states:
        blob = encoder.encode(state).blob
        applied = await cluster.controls[0].upload(body(blob, 1 << 20), "policy", Publish())
        assert applied.digest == weights_digest(state)
        encoder.remember(state, applied.versions.policy, applied.digest)


async def test_a_delta_reaches_every_replica_and_a_late_one_catches_up(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (as a model whose deltas are smaller than its checkpoint: the chain is kept)
    monkeypatch.setattr(WeightsService, "checkpoint_bytes", lambda self, model: 1 << 30)
    states = steps(2)
    await push_deltas(cluster, states)
    assert cluster.versions() == [2, 2]
    cluster.assert_serving(states[-1])
    recorded = (await cluster.ledger.state()).models["policy"]
    assert recorded.shipment is None and [v for v, _ in recorded.chain] == [1, 2]

    late = cluster.start_replica()
    replica = cluster.replicas[-1]
    token = pins.REQUEST.set(pins.Noted(pin=pins.Pin(minimum=2)))
    try:
        with pytest.raises(VersionBehind):  # held out: below the pinned version
            async with replica.weights.registry.gate.admitted("score"):
                pass
        await late.catch_up()
        async with replica.weights.registry.gate.admitted("score") as version:
            assert version == 2
    finally:
        pins.REQUEST.reset(token)
    cluster.assert_serving(states[-1])
    assert replica.weights.registry.digests.of("policy") == weights_digest(states[-1])


async def test_a_long_chain_is_replaced_by_a_whole_checkpoint(cluster: Cluster) -> None:
    """Deltas of a tiny model are larger than it: the chain gives way to the whole weights
    at once, and a late replica catches up from them."""
    states = steps(3)
    await push_deltas(cluster, states)
    recorded = (await cluster.ledger.state()).models["policy"]
    assert recorded.chain == () and recorded.version == 3 and recorded.shipment is not None
    late = cluster.start_replica()
    await late.catch_up()
    assert cluster.versions() == [3, 3, 3]
    cluster.assert_serving(states[-1])


async def test_a_replica_on_other_weights_refuses_the_delta_for_all(cluster: Cluster) -> None:
    cluster.replicas[1].policy.state["w"][0] = 9.0  # (as a replica gone wrong would be)
    encoder = DeltaEncoder()
    encoder.remember(BASE, 0, None)
    blob = encoder.encode(steps(1)[0]).blob
    with pytest.raises(Conflict) as refused:
        await cluster.controls[0].upload(body(blob, 1 << 20), "policy", Publish())
    assert "1 of 2 replicas refused it" in str(refused.value)
    assert "does not rebuild to its checksum" in str(refused.value)
    assert cluster.versions() == [0, 0]
    assert torch.equal(cluster.replicas[0].policy.state["w"], BASE["w"])
