"""LoRA adapters over several replicas (app.deploy.replicated): every replica serves each
adapter at the same version, and one that starts later catches up to what the ledger
recorded (version, tensors, owner, pause). Each replica is a real transformers registry on
the built-in model; PEFT's own forward of the same adapter is the expected value."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import save

from app.adapters.router import PUSHED
from app.common.caller import Caller
from app.common.failures import Forbidden, InvalidInput, NotFound, PeerFailed, worded
from app.config import Settings
from app.deploy.ledger import LocalLedger
from app.deploy.replicated import ReplicatedWeights
from app.engine.registry import ModelRegistry
from app.engine.types import ScoreSpec
from app.updates.local import LocalWeights
from app.updates.types import Streamed
from tests.adapters.models import peft_model
from tests.conftest import forward_log_probs
from tests.deploy.replicas import FakeReplicas, InProcessReplica

SEQUENCES = [[1, 5, 9, 13, 22, 7, 3], [4, 4, 8, 100, 2]]
QV = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
MLP = {"r": 2, "lora_alpha": 4, "target_modules": ["down_proj"]}
ALICE, BOB = Caller("alice", admin=False), Caller("bob", admin=False)


class Deployment:
    """Replicas of one deployment, each with its own registry and data, one ledger."""

    def __init__(self, settings: Settings, tmp: Path) -> None:
        self.settings, self.tmp = settings, tmp
        self.ledger = LocalLedger()
        self.replicas: list[InProcessReplica] = []
        self.handle = FakeReplicas(self.replicas, self.ledger)
        self.controls: list[ReplicatedWeights] = []
        self.names = itertools.count()

    async def start_replica(self) -> ReplicatedWeights:
        name = f"r{next(self.names)}"
        settings = self.settings.replace(storage={"data_dir": self.tmp / name})
        registry = ModelRegistry(
            settings.models, settings.vllm, batching=None, state_dir=self.tmp / name / "vllm"
        )
        await registry.load()
        local = LocalWeights(registry, settings.weights, settings.storage.data_dir)
        self.replicas.append(InProcessReplica(name, local))
        control = ReplicatedWeights(local, self.handle, wait_s=10, chunk_bytes=4096)
        self.controls.append(control)
        return control

    def registries(self) -> list[ModelRegistry]:
        return [r.weights.registry for r in self.replicas]

    async def assert_serve(self, name: str, version: int, expected: torch.nn.Module) -> None:
        """Every replica serves adapter `name` at `version`, as `expected` computes it."""
        for registry in self.registries():
            adapter = registry.adapters[name]
            assert adapter.version == version
            backend = registry.models["policy"].backend
            items = [(seq, ScoreSpec(adapter=adapter)) for seq in SEQUENCES]
            for (seq, _), result in zip(items, await backend.score_detailed(items), strict=True):
                want = forward_log_probs(expected, seq)
                assert torch.allclose(result.log_probs, torch.tensor(want), atol=1e-5)


@pytest.fixture
async def deployment(settings: Settings, tmp_path: Path) -> AsyncIterator[Deployment]:
    made = Deployment(settings, tmp_path)
    for _ in range(2):
        await made.start_replica()
    yield made
    for replica in made.replicas:
        await replica.weights.aclose()
        await replica.weights.registry.aclose()


def saved(model: PeftModel, into: Path) -> Path:
    model.save_pretrained(into, save_embedding_layers=False)
    return into


def body(data: bytes, size: int = 10_000) -> Streamed:
    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(data), size):
            yield data[start : start + size]

    return Streamed(chunks())


def tensors_of(model: PeftModel) -> bytes:
    return save(get_peft_model_state_dict(model))


async def test_every_replica_serves_an_adapter_and_a_new_one_catches_up(
    deployment: Deployment, model_dir: Path, hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    first, second = peft_model(model_dir, 1, **QV), peft_model(model_dir, 2, **QV)
    control = deployment.controls[1]
    loaded = await control.load_adapter("a", str(saved(first, tmp_path / "a")), caller=ALICE)
    assert loaded.version == 0
    await deployment.assert_serve("a", 0, first)
    # (the adapter matters, so the comparison above could fail)
    assert not torch.allclose(
        torch.tensor(forward_log_probs(first, SEQUENCES[0])),
        torch.tensor(forward_log_probs(hf_model, SEQUENCES[0])),
        atol=1e-3,
    )

    # a push of new tensors (no config: the served one) is the next version everywhere
    pushed = await deployment.controls[0].push_adapter("a", body(tensors_of(second)), caller=ALICE)
    assert pushed.version == 1
    await deployment.assert_serve("a", 1, second)
    paused, state = await control.pause_adapter("a", "wait", caller=ALICE)
    assert paused.version == 1 and state.paused == "wait"
    assert [r.adapter_state("a").paused for r in deployment.registries()] == ["wait", "wait"]

    # a replica that starts now serves what the others serve: the version, its owner, paused
    late = await deployment.start_replica()
    await late.catch_up()
    await deployment.assert_serve("a", 1, second)
    registry = deployment.registries()[2]
    assert late.local.adapters.owner("a") == "alice"
    assert registry.adapter_state("a").paused == "wait"
    assert registry.adapters["a"].source == "upload"  # (its last version's)

    _, state = await late.resume_adapter("a", caller=ALICE)
    assert state.paused is None
    assert [r.adapter_state("a").paused for r in deployment.registries()] == [None] * 3
    third = peft_model(model_dir, 3, **QV)
    assert (await late.push_adapter("a", body(tensors_of(third)), caller=ALICE)).version == 2
    await deployment.assert_serve("a", 2, third)


async def test_refusals_leave_every_replica_as_it_was(
    deployment: Deployment, model_dir: Path, tmp_path: Path
) -> None:
    control = deployment.controls[0]
    qv = peft_model(model_dir, 1, **QV)
    await control.load_adapter("a", str(saved(qv, tmp_path / "a")), caller=ALICE)

    # another key's push, pause or unload: refused by name (the role the push route words
    # as "name", once the refusal crossed the replicas), nothing changes anywhere
    with pytest.raises(Forbidden) as refused, worded(PUSHED):
        await control.push_adapter("a", body(tensors_of(qv)), caller=BOB)
    assert refused.value.param == "name" and refused.value.message.startswith("name: ")
    with pytest.raises(Forbidden):
        await control.pause_adapter("a", "keep", caller=BOB)
    with pytest.raises(Forbidden):
        await control.unload_adapter("a", caller=BOB)
    # another layout, pushed: every replica refuses it, naming the body
    other = peft_model(model_dir, 2, **MLP)
    with pytest.raises(InvalidInput) as refused, worded(PUSHED):
        await control.push_adapter("a", body(tensors_of(other)), caller=ALICE)
    assert refused.value.param == "body" and "2 of 2 replicas refused it" in refused.value.message
    # a name never served, pushed without a config
    with pytest.raises(NotFound) as refused, worded(PUSHED):
        await control.push_adapter("b", body(tensors_of(qv)), caller=ALICE)
    assert refused.value.param == "name"
    for registry in deployment.registries():
        assert registry.adapters.keys() == {"a"} and registry.adapters["a"].version == 0
    assert (await deployment.ledger.state()).adapter_versions == {"a": 0}

    # a replica that cannot be reached: the others serve the new version, and it is said
    deployment.handle.unreachable[("r1", "adapter_serve")] = "replica r1 died"
    with pytest.raises(PeerFailed, match=r"1 of 2 replicas failed .* replica r1 died"):
        await control.push_adapter("a", body(tensors_of(qv)), caller=ALICE)
    assert [r.adapters["a"].version for r in deployment.registries()] == [1, 0]
    assert (await deployment.ledger.state()).adapters["a"].version == 1


async def test_an_unloaded_adapter_is_gone_everywhere_and_its_versions_go_on(
    deployment: Deployment, model_dir: Path, tmp_path: Path
) -> None:
    control = deployment.controls[0]
    first, other = peft_model(model_dir, 1, **QV), peft_model(model_dir, 2, **MLP)
    await control.load_adapter("a", str(saved(first, tmp_path / "a")), caller=ALICE)
    assert (await deployment.controls[1].unload_adapter("a", caller=ALICE)).version == 0
    for registry in deployment.registries():
        assert "a" not in registry.adapters
    late = await deployment.start_replica()
    await late.catch_up()
    assert "a" not in deployment.registries()[2].adapters
    # loaded again (another layout: a load may change it), as its next version
    again = await late.load_adapter("a", str(saved(other, tmp_path / "b")), caller=ALICE)
    assert again.version == 1
    await deployment.assert_serve("a", 1, other)
