"""Training with TorchRL's own classes on rlserve: `RLServeWeightUpdater` behind
`LLMCollector.update_policy_weights_` (collective transfer and upload), the collector's policy
version following the server's, `RemotePolicy` output read by `GRPOLoss` as TorchRL's wrappers'
is, `AsyncLLMCollector`'s staleness bound, and `examples/torchrl_grpo.py` taking steps on the
default model. Each module-level server is this module's own: the tests change its weights."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import Server, running_server
from tests.e2e.trainer import learn, policy_server, policy_source, trainer_model
from tests.torchrl import torchrl_only

pytestmark = torchrl_only
EXAMPLE = Path(__file__).parents[2] / "examples" / "torchrl_grpo.py"
ROWS = [{"query": f"What is {a} + {a}?", "answer": str(2 * a)} for a in range(1, 9)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with policy_server(tmp_path_factory.mktemp("torchrl-training")) as s:
        yield s


@pytest.fixture()
def client(server: Server) -> Iterator[object]:
    from rlserve_client import Client

    with Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(autouse=True)
def _list_to_stack() -> Iterator[None]:
    from tensordict import set_list_to_stack

    with set_list_to_stack(True):
        yield


def chat_env(tokenizer, repeats: int = 2):  # type: ignore[no-untyped-def]
    from tensordict import TensorDict
    from torch.utils.data import DataLoader
    from torchrl.envs import StepCounter
    from torchrl.envs.llm import ChatEnv

    def collate(rows: list[dict[str, str]]) -> TensorDict:
        return torch.stack([TensorDict.from_dict(r) for r in rows])

    loader = DataLoader(ROWS, batch_size=1, collate_fn=collate)
    env = ChatEnv.from_dataloader(
        loader, batch_size=(repeats,), repeats=repeats, tokenizer=tokenizer, input_mode="history"
    )
    env.append_transform(StepCounter(max_steps=1))
    return env


def collector_of(client, policy, updater, **options):  # type: ignore[no-untyped-def]
    """TorchRL's LLMCollector of `policy` over `chat_env` (the served model's tokenizer), two
    dialog turns a batch, its weights pushed by `updater`."""
    from torchrl.collectors.llm import LLMCollector
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_source(client))
    return LLMCollector(
        chat_env(tokenizer),
        policy=policy,
        dialog_turns_per_batch=2,
        weight_updater=updater,
        **options,
    )


def served_log_probs(client, ids: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    (sample,) = client.logprobs(tokens=[ids]).outputs
    return [0.0, *sample.log_probs.full[1:]]


@pytest.mark.parametrize("transfer", ["collective", "upload"])
def test_update_policy_weights_pushes_and_the_collector_counts_the_servers_versions(
    client, transfer
):
    from rlserve_client.policy import RemotePolicy
    from rlserve_client.torchrl_weights import RLServeWeightUpdater

    model = trainer_model(client)
    updater = RLServeWeightUpdater(client, model=model, transfer=transfer)
    policy = RemotePolicy(client, generate_kwargs={"max_new_tokens": 3})
    collector = collector_of(client, policy, updater, track_policy_version=True)
    probe = [5, 17, 42, 99, 100, 7, 3]
    try:
        for k in range(2):
            before = client.weights_version().policy_version
            learn(model, seed=k)
            if k == 0:
                collector.update_policy_weights_()  # the registered model
            else:
                collector.update_policy_weights_(model.state_dict())
            after = client.weights_version().policy_version
            assert after == before + 1 == updater.last.policy_version
            assert collector.policy_version == after
            served = served_log_probs(client, probe)
            assert_close(served, forward_log_probs(model, probe), 1e-4)
        data = next(iter(collector))
        assert (data["policy_version"] == after).all()
    finally:
        collector.shutdown()
        updater.close()
    assert updater.transfer == transfer


def test_the_updater_pushes_a_lora_adapter_and_the_collector_counts_its_versions(client, tmp_path):
    """adapter=: the trainer's PEFT adapter alone goes to the server (no pause), each push its
    next version; RemotePolicy samples with it and the collector counts its versions, while
    the policy itself stays at its version."""
    from peft import LoraConfig, get_peft_model
    from rlserve_client.policy import RemotePolicy
    from rlserve_client.torchrl_weights import RLServeWeightUpdater

    client.restore_weights()  # the trainer's base is the served folder's weights
    policy_version = client.weights_version().policy_version
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(trainer_model(client), config)
    model.save_pretrained(tmp_path)
    assert client.load_adapter(name="torchrl-lora", path=tmp_path).version == 0
    updater = RLServeWeightUpdater(client, model=model, adapter="torchrl-lora")
    policy = RemotePolicy(client, model="torchrl-lora", generate_kwargs={"max_new_tokens": 3})
    collector = collector_of(client, policy, updater, track_policy_version=True)
    probe = [5, 17, 42, 99, 100, 7, 3]
    try:
        for k in range(2):
            generator = torch.Generator().manual_seed(k)
            with torch.no_grad():  # a stand-in for a step: the adapter's weights move
                for p in model.parameters():
                    if p.requires_grad:
                        p.add_(torch.randn(p.shape, generator=generator) * 0.05)
            collector.update_policy_weights_()
            assert updater.last.version == k + 1 == collector.policy_version
            (sample,) = client.logprobs(model="torchrl-lora", tokens=[probe]).outputs
            served = [0.0, *sample.log_probs.full[1:]]
            assert_close(served, forward_log_probs(model, probe), 1e-4)
            assert served != served_log_probs(client, probe)  # the adapter, not the policy
        data = next(iter(collector))
        assert (data["policy_version"] == 2).all()
        assert client.weights_version().policy_version == policy_version
    finally:
        collector.shutdown()
        client.unload_adapter(name="torchrl-lora")


def test_grpo_loss_reads_remote_policy_output_as_torchrls_wrappers(client):
    """A generation's log_probs.full is NaN over the prompt (TorchRL's vLLMWrapper layout: no
    invented 0.0), the response's log-probs after it; GRPOLoss then weighs exactly the
    response tokens, with a ratio of 1 against the same weights."""
    from rlserve_client.policy import RemotePolicy
    from rlserve_client.torchrl_weights import RLServeWeightUpdater
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper
    from torchrl.modules.llm.policies import ChatHistory
    from torchrl.objectives.llm import GRPOLoss
    from transformers import AutoTokenizer

    model = trainer_model(client)
    RLServeWeightUpdater(client, transfer="upload").push(model.state_dict())  # serve these
    source = policy_source(client)
    tokenizer = AutoTokenizer.from_pretrained(source)
    policy = RemotePolicy(
        client, versions_key="token_versions", generate_kwargs={"max_new_tokens": 4, "seed": 1}
    )
    assert policy.out_keys[-1] == "token_versions"
    chats = [[{"role": "user", "content": r["query"]}] for r in ROWS[:2]]
    td = TensorDict({"history": ChatHistory(prompt=History.from_chats(chats))}, batch_size=[2])
    out = policy(td)
    version = client.weights_version().policy_version
    for row in out.unbind(0):
        prompt_len = len(row["tokens", "prompt"])
        full = row["log_probs", "full"]
        assert full.shape == row["tokens", "full"].shape
        assert full[:prompt_len].isnan().all()
        assert torch.equal(full[prompt_len:], row["log_probs", "response"])
        assert row["token_versions"].tolist() == [version] * len(row["tokens", "response"])
    out["advantage"] = torch.tensor([[[1.0]], [[-1.0]]])
    actor = TransformersWrapper(
        model, tokenizer=tokenizer, input_mode="tokens", generate=False, pad_output=False
    )
    loss = GRPOLoss(actor, entropy_coeff=0.0, masking_strategy="sft")(out)
    assert math.isfinite(loss.loss_objective.item())
    # the same weights on both sides: every ratio ~1, nothing clipped, no KL to speak of
    assert loss.clip_fraction.item() == 0.0 and abs(loss.kl_approx.item()) < 1e-6


def test_async_llm_collector_bounds_staleness(client):
    """One-step-off TorchRL collection: batches sampled a version behind are handed over; after
    two pushes the batch collected beside the first is over the bound and replaced."""
    from rlserve_client.policy import RemotePolicy
    from rlserve_client.torchrl_async import AsyncLLMCollector
    from rlserve_client.torchrl_weights import RLServeWeightUpdater

    model = trainer_model(client)
    policy = RemotePolicy(
        client, versions_key="token_versions", generate_kwargs={"max_new_tokens": 4}
    )
    updater = RLServeWeightUpdater(client, model=model)
    collector = collector_of(client, policy, updater)
    versions = []
    with AsyncLLMCollector(collector, client, max_staleness=1) as ahead:
        for k, data in enumerate(ahead):
            served = client.weights_version().policy_version
            rows = data.reshape(-1).get("token_versions", as_list=True)
            oldest = min(min(v.tolist()) for v in rows)
            versions.append(served - oldest)
            for push in range(2 if k == 0 else 1):
                learn(model, seed=10 * k + push)
                ahead.update_policy_weights_()
            if k == 2:
                break
        stats = ahead.stats
    updater.close()
    assert all(s <= 1 for s in versions) and versions[0] == 0
    assert stats.regenerated == 2 and stats.batches == 3  # the one batch sampled at version 0


def test_the_examples_reward_reads_each_rows_reply_and_answer():
    """The example's reward, through a TorchRL step: 1.0 exactly where the reply's last number
    is the row's answer (strings read from non-tensor stacks, not their reprs)."""
    from tensordict import TensorDict, lazy_stack

    from examples.torchrl_grpo import LastNumberReward

    rows = [("7 + 5 = 12.", "12"), ("It is 12, not 13", "12"), ("no idea", "4"), ("4", "4")]
    td = lazy_stack(
        [TensorDict({"text": {"response": r}, "answer": a}, batch_size=[]) for r, a in rows]
    )
    out = LastNumberReward()._step(td, TensorDict({}, batch_size=[4]))
    assert out["reward"].flatten().tolist() == [1.0, 0.0, 0.0, 1.0]


@pytest.mark.slow
def test_torchrl_grpo_example_learns_on_the_default_model(tmp_path):
    """examples/torchrl_grpo.py for two steps on SmolLM2-135M-Instruct (the served default,
    with its reference): TorchRL's loop, one-step-off with the decoupled loss and KL."""
    from app.config_groups import DEFAULT_MODEL

    env = {
        "RLSERVE_MODELS__MODEL": DEFAULT_MODEL,
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path),
        "RLSERVE_MODELS__BACKEND": "transformers",
    }
    log = tmp_path / "steps.jsonl"
    with running_server(env=env, log=tmp_path / "server.log", ready_timeout=600) as server:
        command = [
            *[sys.executable, "-W", "ignore", str(EXAMPLE), "--url", server.url],
            *["--steps", "2", "--prompts", "1", "--group-size", "4", "--max-new-tokens", "16"],
            *["--kl-coeff", "0.05", "--max-staleness", "1", "--log", str(log)],
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert [r["policy_version"] for r in records] == [1, 2]
    assert [r["collector_version"] for r in records] == [1, 2]
    for record in records:
        assert record["samples"] == 4 and 0.0 <= record["reward"] <= 1.0
        assert math.isfinite(record["loss"]) and record["grad_norm"] >= 0.0


@pytest.mark.slow
def test_torchrl_grpo_benchmark_quick(tmp_path):
    root = Path(__file__).parents[2]
    command = [sys.executable, "-W", "ignore", "bench/torchrl_grpo.py", "--quick"]
    subprocess.run([*command, "--output", str(tmp_path)], cwd=root, check=True, timeout=900)
    report = json.loads((tmp_path / "torchrl_grpo-quick.json").read_text())
    assert set(report["summary"]) == {"synchronous", "one-step-off"}
    for run in report["summary"].values():
        assert run["steps"] == 2 and run["samples"] == 32
    assert (tmp_path / "torchrl_grpo-quick.png").stat().st_size > 0
