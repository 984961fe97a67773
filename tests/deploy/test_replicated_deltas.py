"""Deltas on a deployment of several replicas: each replica rebuilds the delta from its own
weights and checks it, and all commit it or none does; a replica that starts later catches up
along the ledger's chain (or from the whole checkpoint that replaced it) before it serves, and
refuses a request pinned to a version it does not hold yet."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from rlserve_client.weight_delta import TRANSFER_NAME, DeltaEncoder, weights_digest
from safetensors.torch import save, save_file

from app.common.failures import Conflict, InvalidInput, PeerFailed, VersionBehind
from app.engine import pins
from app.updates.service import WeightsService
from app.updates.types import Announcement, Applied, Publish, SnapshotAsk
from tests.deploy.test_replicated_weights import BASE, Cluster, body, init


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


async def test_one_snapshot_call_loads_every_replica_and_a_late_one_catches_up(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WeightsService, "checkpoint_bytes", lambda self, model: 1 << 30)
    first, second = steps(2)
    whole = tmp_path / "first.safetensors"
    save_file(first, str(whole))
    await cluster.controls[1].load_snapshot(SnapshotAsk("v1", str(whole)))
    encoder = DeltaEncoder()
    encoder.remember(first, 1, weights_digest(first))
    (tmp_path / "second.delta").write_bytes(encoder.encode(second).blob)
    ask = SnapshotAsk("v2", str(tmp_path / "second.delta"), base="v1")
    applied = await cluster.controls[0].load_snapshot(ask)
    assert applied.snapshot == "v2" and applied.digest == weights_digest(second)
    late = cluster.start_replica()
    states = await cluster.controls[0].served("policy")
    assert [(s.replica, s.version, s.snapshot) for s in states] == [
        ("r0", 2, "v2"),
        ("r1", 2, "v2"),
        ("r2", 0, None),  # started, not caught up: held out of routing until it is
    ]
    await late.catch_up()
    states = await cluster.controls[0].served("policy")
    assert {(s.version, s.snapshot, s.digest) for s in states} == {
        (2, "v2", weights_digest(second))
    }
    cluster.assert_serving(second)


async def test_a_replica_that_fell_behind_catches_up_and_says_so_meanwhile(
    cluster: Cluster,
) -> None:
    """Its commit failed where the other's succeeded: its health check says it lags (Ray
    Serve then routes nothing to it) and it catches up; a pinned request it cannot serve is
    refused meanwhile."""
    state = steps(1)[0]
    cluster.replicas[1].policy.fail_swap = "device lost"
    with pytest.raises(PeerFailed):
        await cluster.controls[0].upload(body(save(state), 1 << 20), "policy", Publish())
    cluster.replicas[1].policy.fail_swap = None
    assert cluster.versions() == [1, 0]
    assert await cluster.controls[0].lagging() is None
    token = pins.REQUEST.set(pins.Noted(pin=pins.Pin(minimum=1)))
    try:
        with pytest.raises(VersionBehind):
            async with cluster.replicas[1].weights.registry.gate.admitted("generate"):
                pass
    finally:
        pins.REQUEST.reset(token)
    lag = await cluster.controls[1].lagging()
    assert lag is not None and "policy at version 0, not 1" in lag
    catching = cluster.controls[1]._catching
    assert catching is not None
    await catching
    assert cluster.versions() == [1, 1] and await cluster.controls[1].lagging() is None
    cluster.assert_serving(state)


def delta_announced(blob: bytes) -> Announcement:
    return Announcement("policy", [TRANSFER_NAME], ["uint8"], [[len(blob)]], delta=True)


async def transfer_delta(cluster: Cluster, blob: bytes) -> Applied:
    """The trainer's delta over the group: announced, broadcast to every replica, finished."""
    control = cluster.controls[0]
    await control.transfer_start("policy")
    await control.transfer_update(delta_announced(blob))
    cluster.trainer.send({TRANSFER_NAME: torch.frombuffer(bytearray(blob), dtype=torch.uint8)})
    return await control.transfer_finish("policy", Publish())


async def test_a_delta_over_the_transfer_reaches_every_replica_and_a_late_one_replays_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(WeightsService, "checkpoint_bytes", lambda self, model: 1 << 30)
    await cluster.controls[0].transfer_init(init(world_size=3))
    encoder = DeltaEncoder()
    encoder.remember(BASE, 0, weights_digest(BASE))
    for state in steps(2):
        blob = encoder.encode(state).blob
        applied = await transfer_delta(cluster, blob)
        assert applied.digest == weights_digest(state) and applied.sent_bytes is not None
        encoder.remember(state, applied.version, applied.digest)
    assert cluster.versions() == [2, 2]
    cluster.assert_serving(steps(2)[-1])
    recorded = (await cluster.ledger.state()).models["policy"]
    assert [v for v, _ in recorded.chain] == [1, 2]  # (the deltas, as sent)
    late = cluster.start_replica()
    await late.catch_up()
    cluster.assert_serving(steps(2)[-1])


async def test_a_transferred_delta_one_replica_cannot_rebuild_is_refused_by_all(
    cluster: Cluster,
) -> None:
    await cluster.controls[0].transfer_init(init(world_size=3))
    cluster.replicas[1].policy.state["b"][1] = 5.0  # (a replica gone wrong)
    encoder = DeltaEncoder()
    encoder.remember(BASE, 0, None)
    state = {"w": BASE["w"], "b": torch.tensor([0.0, 1.0])}
    with pytest.raises(Conflict) as refused:
        await transfer_delta(cluster, encoder.encode(state).blob)
    assert "1 of 2 replicas refused it" in str(refused.value)
    assert cluster.versions() == [0, 0]
    assert torch.equal(cluster.replicas[0].policy.state["b"], BASE["b"])
    assert (await cluster.controls[0].transfer_state("policy")).state == "joined"

    mixed = Announcement(
        "policy", [TRANSFER_NAME, "w"], ["uint8", "float32"], [[4], [4]], delta=True
    )
    await cluster.controls[0].transfer_start("policy")
    with pytest.raises(InvalidInput, match="one uint8 tensor"):
        await cluster.controls[0].transfer_update(mixed)
