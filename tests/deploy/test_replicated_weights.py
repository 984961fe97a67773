"""One weight update over several replicas, as one transaction (app.deploy.replicated), with
no Ray: each replica is a real `LocalWeights` over a small model of two tensors, reached
through a fake handle that pickles what crosses (as Ray would) and can make a replica fail
a step; the ledger is the in-process one. Every replica ends on the same version with the
same weights, or all stay where they were."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path

import pytest
import torch
from rlserve_client.weight_delta import tensor_checksum
from safetensors.torch import save, save_file

from app.common.caller import UNKEYED
from app.common.failures import Conflict, InvalidInput, PeerFailed, TimedOut, Unsupported
from app.common.roles import Role
from app.config import Settings
from app.deploy.ledger import LocalLedger
from app.deploy.replicated import ReplicatedWeights
from app.dialects.sglang.protocol import UpdateWeightsFromDistributed
from app.dialects.sglang.service import bucket_of
from app.engine.base import Capabilities
from app.engine.registry import ModelRegistry
from app.errors import failure_error
from app.updates.driven import DrivenUpdates
from app.updates.local import LocalWeights
from app.updates.types import AdapterPush, Announcement, Join, Publish, Streamed
from app.weights.checkpoint import Layout, copy_into, layout_of_state, to_safetensors
from app.weights.delta import Change, write_changes
from app.weights.staging import TransferPlan
from app.weights.transfer_engine import WeightTransfer
from app.weights.transport import Connection
from tests.deploy.replicas import FakeReplicas, InProcessReplica
from tests.fake.backend import FakeBackend

BASE = {"w": torch.arange(4.0), "b": torch.zeros(2)}


class Trainer:
    """The trainer's end of a fake collective: it delivers tensors to the replicas in its
    group (all, or all but some), or goes away."""

    def __init__(self) -> None:
        self.group: dict[str, FakeTransfer] = {}
        self.lost = False

    def send(self, tensors: dict[str, torch.Tensor], skip: frozenset[str] = frozenset()) -> None:
        for replica, transfer in self.group.items():
            if replica not in skip:
                transfer.deliver(tensors)

    def die(self) -> None:
        self.lost = True
        for transfer in self.group.values():
            transfer.arrived.set()


class FakeTransfer(WeightTransfer):
    def __init__(self, replica: str, backend: SmallModel, trainer: Trainer) -> None:
        self.replica, self.backend, self.trainer = replica, backend, trainer
        self.arrived = asyncio.Event()
        self.staged: dict[str, torch.Tensor] = {}

    def deliver(self, tensors: dict[str, torch.Tensor]) -> None:
        self.staged = {k: v.clone() for k, v in tensors.items()}
        self.arrived.set()

    async def init(self, connection: Connection) -> None:
        self.trainer.group[self.replica] = self

    async def start(self, *, adapter: bool = False) -> None:
        self.arrived, self.staged = asyncio.Event(), {}

    async def update(self, plan: TransferPlan) -> None:
        pass

    async def received(self, timeout_s: float) -> None:
        await asyncio.wait_for(self.arrived.wait(), timeout_s)  # TimeoutError: TimedOut
        if self.trainer.lost:
            raise ConnectionError("Connection closed by peer")

    async def checkpoint(self) -> bytes:
        return to_safetensors(self.staged)

    async def commit(self, version: int) -> None:
        for name, tensor in self.staged.items():
            self.backend.state[name].copy_(tensor)
        await self.abort()

    async def abort(self) -> None:
        self.arrived, self.staged = asyncio.Event(), {}

    async def close(self) -> None:
        await self.abort()
        self.trainer.group.pop(self.replica, None)


class SmallModel(FakeBackend):
    """A model of two float tensors that takes file updates and transfers; `fail_swap` makes
    its next swap fail (a device gone)."""

    capabilities = Capabilities(weight_transfer=True, weight_deltas=True)

    def __init__(self, name: str, replica: str, trainer: Trainer) -> None:
        super().__init__(name, lambda _: -1.0)
        self.state = {k: v.clone() for k, v in BASE.items()}
        self.fail_swap: str | None = None
        self._transfer = FakeTransfer(replica, self, trainer)

    def weight_layout(self) -> Layout:
        return layout_of_state(self.state)

    async def update_weights(self, files: list[Path]) -> None:
        if self.fail_swap is not None:
            raise RuntimeError(self.fail_swap)
        await asyncio.to_thread(copy_into, self.state, files)

    def transfer(self) -> WeightTransfer:
        return self._transfer

    def served_tensor(self, name: str) -> torch.Tensor | None:
        return self.state.get(name)

    async def write_tensors(self, changes: dict[str, Change]) -> None:
        if self.fail_swap is not None:
            raise RuntimeError(self.fail_swap)
        write_changes(self.state, changes)

    def weight_checksums(
        self, names: Iterable[str] | None = None, known: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        wanted = self.state if names is None else {n: self.state[n] for n in names}
        return {name: tensor_checksum(t) for name, t in wanted.items()}


class Replica(InProcessReplica):
    @property
    def policy(self) -> SmallModel:
        backend = self.weights.registry.models["policy"].backend
        assert isinstance(backend, SmallModel)
        return backend

    @property
    def version(self) -> int:
        return self.weights.registry.versions["policy"]


class Cluster:
    """N replicas, each with its own data, registry and control (as each replica of a Ray
    Serve deployment has), one ledger and one trainer."""

    def __init__(self, tmp: Path, num_replicas: int, chunk_bytes: int = 64) -> None:
        self.tmp, self.chunk_bytes = tmp, chunk_bytes
        self.trainer = Trainer()
        self.ledger = LocalLedger()
        self.names = itertools.count()
        self.replicas: list[Replica] = []
        self.handle = FakeReplicas(self.replicas, self.ledger)
        self.controls: list[ReplicatedWeights] = []
        for _ in range(num_replicas):
            self.start_replica()

    def start_replica(self) -> ReplicatedWeights:
        """A new replica (models loaded, not yet caught up) in the deployment."""
        name = f"r{next(self.names)}"
        settings = Settings(
            models={"model": "builtin:tiny", "cache_dir": self.tmp / "cache"},
            storage={"data_dir": self.tmp / name},
        )
        registry = ModelRegistry(
            settings.models, settings.vllm, batching=None, state_dir=self.tmp / name / "vllm"
        )
        for model in ("policy", "reference"):
            registry.add(SmallModel(model, name, self.trainer))
        registry.status = "ready"
        local = LocalWeights(registry, settings.weights, settings.storage.data_dir)
        self.replicas.append(Replica(name, local))
        control = ReplicatedWeights(local, self.handle, wait_s=10, chunk_bytes=self.chunk_bytes)
        self.controls.append(control)
        return control

    def replace(self, index: int) -> ReplicatedWeights:
        """The replica at `index` dies and another starts in its place."""
        del self.replicas[index], self.controls[index]
        return self.start_replica()

    def versions(self) -> list[int]:
        return [r.version for r in self.replicas]

    def assert_serving(self, expected: dict[str, torch.Tensor]) -> None:
        for replica in self.replicas:
            for name, tensor in expected.items():
                assert torch.equal(replica.policy.state[name], tensor), (replica.name, name)

    def staged_leftovers(self) -> list[Path]:
        return [p for r in self.replicas for p in r.weights.files.uploads.glob("staged-*")]


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(tmp_path, num_replicas=3)
    yield made
    for replica in made.replicas:
        await replica.weights.aclose()


def checkpoint(tmp: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp / f"{name}.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def scaled(scale: float) -> dict[str, torch.Tensor]:
    return {k: v * scale + 1 for k, v in BASE.items()}


def body(data: bytes, size: int = 50) -> Streamed:
    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), size):
            yield data[start : start + size]

    return Streamed(chunks())


async def test_an_upload_reaches_every_replica_in_bounded_chunks(cluster: Cluster) -> None:
    new = scaled(2.0)
    data = save(new)
    updated = await cluster.controls[0].upload(body(data), "policy", Publish())
    assert updated.versions.policy == 1 and updated.num_tensors == 2
    assert cluster.versions() == [1, 1, 1]
    cluster.assert_serving(new)
    assert sum(cluster.handle.chunks) == len(data) and max(cluster.handle.chunks) <= 64
    assert cluster.staged_leftovers() == []
    uploads = cluster.replicas[0].weights.files.uploads
    assert list(uploads.glob("*.safetensors")) == []  # the streamed body is gone too


async def test_a_load_by_path_reaches_every_replica(cluster: Cluster, tmp_path: Path) -> None:
    new = scaled(3.0)
    path = str(checkpoint(tmp_path, "new", new))
    assert (await cluster.controls[1].load(path, "policy", Publish(version=7))).versions.policy == 7
    assert cluster.versions() == [7, 7, 7]
    cluster.assert_serving(new)


async def test_a_refusal_at_staging_leaves_every_replica_as_it_was(
    cluster: Cluster, tmp_path: Path
) -> None:
    """One replica's model has another shape: its check refuses the checkpoint, so no replica
    applies it, and the error is that replica's (same kind, same field)."""
    cluster.replicas[2].policy.state["w"] = torch.zeros(5)
    path = str(checkpoint(tmp_path, "new", scaled(2.0)))
    with pytest.raises(InvalidInput) as refused:
        await cluster.controls[0].load(path, "policy", Publish())
    assert refused.value.role == Role.TENSORS
    assert failure_error(refused.value).message == (
        "weights: 'w' has shape [4], the model's is [5] (1 of 3 replicas refused it)"
    )
    assert refused.value.param == "weights"
    assert cluster.versions() == [0, 0, 0]
    for replica in cluster.replicas[:2]:
        assert torch.equal(replica.policy.state["w"], BASE["w"])
    assert cluster.staged_leftovers() == []
    assert (await cluster.ledger.state()).models == {}

    cluster.handle.unreachable[("r1", "weights_stage")] = "replica r1 died"
    with pytest.raises(PeerFailed, match=r"replica r1 died \(2 of 3 replicas refused it\)"):
        await cluster.controls[0].load(path, "policy", Publish())  # r1's cause comes first
    assert cluster.versions() == [0, 0, 0]


async def test_a_failed_swap_on_one_replica_is_reported(cluster: Cluster, tmp_path: Path) -> None:
    """Every replica checked it, so the others swap it in; the one whose swap failed says so,
    and the ledger has the version a replacement catches up to."""
    new = scaled(2.0)
    cluster.replicas[1].policy.fail_swap = "CUDA error: device lost"
    path = str(checkpoint(tmp_path, "new", new))
    with pytest.raises(PeerFailed) as failed:
        await cluster.controls[0].load(path, "policy", Publish())
    assert failed.value.message == (
        "1 of 3 replicas failed to swap in version 1 after all had checked it: "
        "CUDA error: device lost"
    )
    assert cluster.versions() == [1, 0, 1]
    assert (await cluster.ledger.state()).models["policy"].version == 1
    replacement = cluster.replace(1)
    await replacement.catch_up()
    assert cluster.versions() == [1, 1, 1]
    cluster.assert_serving(new)


async def test_two_racing_updates_apply_one_after_the_other(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Sent to two replicas at once: the lease orders them, so one stages and commits
    everywhere before the other stages; versions strictly increase; every replica serves
    the later one."""
    updates = {"a": scaled(2.0), "b": scaled(5.0)}
    requests = [
        cluster.controls[i].load(str(checkpoint(tmp_path, name, tensors)), "policy", Publish())
        for i, (name, tensors) in enumerate(updates.items())
    ]
    answers = dict(zip(updates, await asyncio.gather(*requests), strict=True))
    first, second = sorted(updates, key=lambda name: answers[name].versions.policy)
    assert [answers[first].versions.policy, answers[second].versions.policy] == [1, 2]
    assert cluster.versions() == [2, 2, 2]
    cluster.assert_serving(updates[second])
    steps = [(step, uid) for step, uid in cluster.handle.log if uid is not None]
    ids = [uid for _, uid in steps]
    assert len(set(ids)) == 2
    assert ids == [ids[0]] * 2 + [ids[-1]] * 2  # stage then commit, one update at a time
    assert [step for step, _ in steps] == ["weights_stage", "weights_commit"] * 2


async def test_a_new_replica_catches_up_before_serving(cluster: Cluster, tmp_path: Path) -> None:
    """A whole update, then a partial one, then a pause: a replica started afterwards serves
    both updates (in their order) under the last version, and is paused like the others."""
    whole = scaled(2.0)
    partial = {"b": torch.tensor([7.0, 8.0])}
    await cluster.controls[0].upload(body(save(whole)), "policy", Publish())
    await cluster.controls[2].upload(body(save(partial)), "policy", Publish(version=5))
    await cluster.controls[0].pause("keep")

    replacement = cluster.replace(0)
    assert cluster.replicas[-1].version == 0
    await replacement.catch_up()
    assert cluster.versions() == [5, 5, 5]
    cluster.assert_serving({"w": whole["w"], "b": partial["b"]})
    assert cluster.replicas[-1].weights.registry.gate.state().paused
    await cluster.controls[0].resume()
    assert not any(r.weights.registry.gate.state().paused for r in cluster.replicas)


async def test_a_collective_transfer_reaches_every_replica(cluster: Cluster) -> None:
    control = cluster.controls[0]
    state = await control.transfer_init(init())
    assert (state.state, state.server_ranks, state.replicas) == ("joined", 3, 3)
    await control.transfer_start("policy")
    await control.transfer_update(announce())
    sent = scaled(4.0)
    cluster.trainer.send(sent)
    updated = await control.transfer_finish("policy", Publish())
    assert updated.versions.policy == 1 and cluster.versions() == [1, 1, 1]
    cluster.assert_serving(sent)
    assert (await control.transfer_state("policy")).state == "joined"

    replacement = cluster.replace(2)  # not in the group: catches up from the ledger
    await replacement.catch_up()
    cluster.assert_serving(sent)
    split = await control.transfer_state("policy")
    assert split.state == "idle" and "1 idle, 2 joined" in (split.last_error or "")


def bucket(version: str | None = None) -> UpdateWeightsFromDistributed:
    return UpdateWeightsFromDistributed(
        names=list(BASE),
        dtypes=["float32"] * len(BASE),
        shapes=[list(t.shape) for t in BASE.values()],
        weight_version=version,
    )


async def test_an_sglang_session_spans_the_replicas_its_calls_reach(cluster: Cluster) -> None:
    """SGLang's begin, its bucket and its end each reach another replica, as a deployment's
    router may send them: one update, committed once at the end, on every replica. AReaL's
    meta, sent to one replica, names the tensors another one receives."""
    dialects = [
        DrivenUpdates(replica.weights.registry, control)
        for replica, control in zip(cluster.replicas, cluster.controls, strict=True)
    ]
    await cluster.controls[0].transfer_init(init())
    await dialects[0].begin()
    assert await dialects[1].receive(bucket_of(bucket("7"))) is None
    sent = scaled(3.0)
    cluster.trainer.send(sent)
    assert cluster.versions() == [0, 0, 0]
    with pytest.raises(Conflict, match="already open"):
        await dialects[1].begin()
    updated = await dialects[2].end()
    assert updated.versions.policy == 7 and cluster.versions() == [7, 7, 7]
    cluster.assert_serving(sent)
    with pytest.raises(Conflict, match="no weight-update session is open"):
        await dialects[0].end()

    await dialects[0].announce(bucket_of(bucket()))
    receiving = asyncio.create_task(dialects[2].receive_announced())
    while (await cluster.controls[1].transfer_state("policy")).state != "updating":
        await asyncio.sleep(0.01)
    again = scaled(5.0)
    cluster.trainer.send(again)
    assert (await receiving).versions.policy == 8 and cluster.versions() == [8, 8, 8]
    cluster.assert_serving(again)
    with pytest.raises(Conflict, match="no tensors were announced"):
        await dialects[1].receive_announced()


async def test_adapter_refusals_across_replicas_name_the_field(cluster: Cluster) -> None:
    """These replicas' backend serves no adapters: a load, and a push over the collective
    transfer, are each a refusal naming its field, which leaves every replica as it was
    (tests/deploy/test_replicated_adapters.py and tests/e2e/test_ray_serve.py serve them)."""
    control = cluster.controls[0]
    await control.transfer_init(init())
    pushed = AdapterPush("a", {"r": 4, "lora_alpha": 8, "target_modules": ["proj"]}, UNKEYED)
    with pytest.raises(Unsupported) as refused:
        await control.transfer_start("policy", pushed)
    assert refused.value.role == Role.ADAPTER_PUSH  # (the transfer routes word it "adapter")
    with pytest.raises(Unsupported) as refused:
        await control.load_adapter("a", "/nowhere", caller=UNKEYED)
    assert refused.value.role == Role.ADAPTER_SOURCE  # (each route names it in its words)
    assert (await control.transfer_state("policy")).state == "joined"
    assert cluster.versions() == [0, 0, 0]


async def test_a_replica_that_never_receives_the_update_drops_it_everywhere(
    cluster: Cluster,
) -> None:
    control = cluster.controls[0]
    await control.transfer_init(init())
    await control.transfer_start("policy")
    await control.transfer_update(announce())
    cluster.trainer.send(scaled(4.0), skip=frozenset({"r1"}))
    with pytest.raises(TimedOut, match=r"\(1 of 3 replicas refused it\)"):
        await control.transfer_finish("policy", Publish())
    assert cluster.versions() == [0, 0, 0]
    cluster.assert_serving(BASE)
    state = await control.transfer_state("policy")  # a stuck peer ends the group everywhere
    assert state.state == "idle" and "TimedOut" in (state.last_error or "")
    assert (await cluster.ledger.state()).models == {}


async def test_a_lost_trainer_drops_the_update_everywhere(cluster: Cluster) -> None:
    control = cluster.controls[0]
    await control.transfer_init(init())
    await control.transfer_start("policy")
    await control.transfer_update(announce())
    cluster.trainer.die()
    for _ in range(100):  # each replica notices by itself, with no finish or abort
        state = await control.transfer_state("policy")
        if state.state == "idle":
            break
        await asyncio.sleep(0.02)
    assert state.state == "idle" and "PeerFailed" in (state.last_error or "")
    with pytest.raises(Conflict, match="not in a weight-transfer group"):
        await control.transfer_finish("policy", Publish())
    assert cluster.versions() == [0, 0, 0]
    cluster.assert_serving(BASE)


async def test_a_replica_that_cannot_join_leaves_no_one_in_the_group(cluster: Cluster) -> None:
    cluster.handle.unreachable[("r2", "transfer_join")] = "replica r2 died"
    with pytest.raises(PeerFailed, match=r"r2 died \(1 of 3 replicas could not join\)"):
        await cluster.controls[0].transfer_init(init())
    assert cluster.trainer.group == {}
    with pytest.raises(InvalidInput, match="leaves no room for the 3 ranks of 3 replicas"):
        await cluster.controls[0].transfer_init(init(world_size=3))


def init(world_size: int = 4) -> Join:
    return Join("policy", Connection("127.0.0.1", 29500, world_size=world_size, timeout_s=1.0))


def announce() -> Announcement:
    return Announcement(
        model="policy",
        names=list(BASE),
        dtype_names=["float32"] * len(BASE),
        shapes=[list(t.shape) for t in BASE.values()],
    )


async def test_sglang_session_calls_on_two_replicas_do_not_interleave(cluster: Cluster) -> None:
    """Calls that reach two replicas at once read and write the one session of the ledger
    atomically: of two begins, one opens the session and the other is refused; a bucket whose
    call raced an end never reopens the session the end committed."""
    dialects = [
        DrivenUpdates(replica.weights.registry, control)
        for replica, control in zip(cluster.replicas, cluster.controls, strict=True)
    ]
    await cluster.controls[0].transfer_init(init())
    begun = await asyncio.gather(dialects[0].begin(), dialects[1].begin(), return_exceptions=True)
    refused = [b for b in begun if isinstance(b, Exception)]
    assert len(refused) == 1 and isinstance(refused[0], Conflict), begun
    assert "already open" in str(refused[0])

    assert await dialects[1].receive(bucket_of(bucket("7"))) is None
    sent = scaled(3.0)
    cluster.trainer.send(sent)
    # An end on one replica and a late bucket naming a version on another, at once.
    late, ended = await asyncio.gather(
        dialects[0].receive(bucket_of(bucket("9"))), dialects[2].end(), return_exceptions=True
    )
    assert not isinstance(ended, BaseException), ended
    # The late bucket went into the committed update or was refused, naming why.
    assert late is None or (isinstance(late, Conflict) and "committed" in str(late)), late
    assert ended.versions.policy == 7 and cluster.versions() == [7, 7, 7]
    # The session the end committed stays closed: whatever the late bucket became, no
    # session is left open that no one began.
    session = await cluster.controls[1].session()
    assert session.kind is None, session
    with pytest.raises(Conflict, match="no weight-update session is open"):
        await dialects[1].end()
