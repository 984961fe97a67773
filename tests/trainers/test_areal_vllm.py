"""AReaL 1.0.4's own remote vLLM engine (`areal.engine.vllm_remote.RemotevLLMEngine`, from its
PyPI release, unmodified) against a real rlserve: its flat `/v1/completions` generation with
`token_id:N` log-probs, and the routes of AReaL's own vLLM server it drives (pause and
continue, a weight update from a path through its name service, its distributed update over
gloo), each ending on the trainer's weights. Runs in .venv-trainers (scripts/test-trainers.sh)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from rlserve_client import Client, ConflictError

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import free_port
from tests.e2e.trainer import learn, policy_server
from tests.trainers.test_areal import generate, served_log_probs, served_model, stop_ids

pytestmark = pytest.mark.trainers
remote = pytest.importorskip("areal.engine.vllm_remote", reason="AReaL is not installed")

from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.api.cli_args import InferenceEngineConfig, NameResolveConfig  # noqa: E402
from areal.api.io_struct import ParamSpec, WeightUpdateMeta  # noqa: E402
from areal.engine.core.distributed import init_custom_process_group  # noqa: E402
from areal.utils import name_resolve, names  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with policy_server(tmp_path_factory.mktemp("areal-vllm")) as running:
        yield running


@pytest.fixture(scope="module")
def engine(server):  # type: ignore[no-untyped-def]
    engine = remote.RemotevLLMEngine(
        InferenceEngineConfig(
            backend="vllm:d1",
            request_timeout=120,
            setup_timeout=120,
            experiment_name="rlserve",
            trial_name="areal-vllm",
        )
    )
    engine.initialize(addr=server.url.removeprefix("http://"))
    yield engine
    engine.destroy()


def test_areal_vllm_generates_and_its_log_probs_are_the_servers(server, engine):
    stops = stop_ids(server.url)
    prompt = [5, 6, 7, 8]
    for greedy in (True, False):
        reply = generate(engine, prompt, max_new_tokens=8, stop_token_ids=stops, greedy=greedy)
        assert reply.input_tokens == prompt and 1 <= len(reply.output_tokens) <= 8
        (full,) = served_log_probs(server.url, [prompt + reply.output_tokens])
        assert_close(reply.output_logprobs, full[len(prompt) :], 1e-4)


def test_areal_vllm_updates_weights_from_a_path_and_over_gloo(server, engine, tmp_path):
    model = served_model(server.url)
    # From a path, as AReaL's FSDP engine runs it: pause, the engine's update (which waits
    # for the trainer's record in AReaL's name service), save, record, continue.
    name_resolve.reconfigure(NameResolveConfig(type="nfs", nfs_record_root=str(tmp_path / "nr")))
    learn(model, seed=7)
    meta = WeightUpdateMeta(
        type="disk", path=str(tmp_path / "step-1"), clear_checkpoint_after_load=False
    )
    engine.pause_generation()
    loaded: Future[Any] = engine.update_weights_from_disk(meta)
    model.save_pretrained(tmp_path / "step-1")
    key = names.update_weights_from_disk("rlserve", "areal-vllm", engine.get_version())
    name_resolve.add(key, str(time.time()), replace=True)
    loaded.result()
    engine.set_version(engine.get_version() + 1)
    engine.continue_generation()
    sequences = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103]]
    for seq, got in zip(sequences, served_log_probs(server.url, sequences), strict=True):
        assert_close(got, forward_log_probs(model, seq), 1e-4)
    # Over gloo, as its trainer does: join once, then per step name the tensors and send them.
    xccl = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation.from_str("vllm:d1"),
        nccl_master_address="127.0.0.1",
        nccl_master_port=free_port(),
        nccl_group_name="update_weight_group",
    )
    joined: Future[Any] = engine.init_weights_update_group(xccl)
    group = init_custom_process_group(
        backend="gloo",
        world_size=2,
        init_method=f"tcp://127.0.0.1:{xccl.nccl_master_port}",
        rank=0,
        group_name="update_weight_group",
    )
    joined.result()
    try:
        for step in range(3):
            learn(model, seed=10 + step)
            named = [(n, p.detach().contiguous()) for n, p in model.named_parameters()]
            specs = [
                ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split(".")[-1])
                for n, t in named
            ]
            engine.pause_generation()
            pending: Future[Any] = engine.update_weights_from_distributed(xccl, specs)
            for _, tensor in named:
                dist.broadcast(tensor, src=0, group=group)
            pending.result()
            engine.continue_generation()
            for seq, got in zip(sequences, served_log_probs(server.url, sequences), strict=True):
                assert_close(got, forward_log_probs(model, seq), 1e-4)
    finally:
        dist.destroy_process_group(group)
    reply = generate(engine, [5, 6, 7], max_new_tokens=4)
    (full,) = served_log_probs(server.url, [[5, 6, 7, *reply.output_tokens]])
    assert_close(reply.output_logprobs, full[3:], 1e-4)
    # AReaL's flow never leaves the server's side of its group. While its trainer's process
    # (this one) still answers at the rendezvous, the next trainer (rlserve's own client) is
    # refused, naming how an admin closes the group; after that close it joins. (Once the
    # trainer's process is gone, the next one joins at once: tests/weights.)
    state = httpx.get(f"{server.url}/v1/weights/transfer").json()
    assert state["state"] == "joined"
    learn(model, seed=20)
    with Client(base_url=server.url) as client:
        with pytest.raises(ConflictError, match="POST /v1/weights/transfer/close"):
            client.weight_transfer().open()
        closed = client.transfer_step(step="close", body={"model": "policy"})  # the admin's
        assert closed.state == "idle"
        with client.weight_transfer() as sync:
            sync.send(model.state_dict())
    for seq, got in zip(sequences, served_log_probs(server.url, sequences), strict=True):
        assert_close(got, forward_log_probs(model, seq), 1e-4)


def test_areal_vllm_scores_sequences_as_the_server_does(server, engine):
    """Its engine's compute_logp (teacher scoring): /v1/completions with echo and
    prompt_logprobs, read back per loss-masked token."""
    sequences = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103, 0, 0]]
    input_ids = torch.tensor(sequences)
    attention = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    loss_mask = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 0, 0]])
    (out,) = engine.compute_logp(
        [{"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention}]
    )
    served = served_log_probs(server.url, [sequences[0], sequences[1][:4]])
    assert_close(out[0, 3:].tolist(), served[0][3:], 1e-4)
    assert_close(out[1, 2:4].tolist(), served[1][2:4], 1e-4)
    assert out[0, :3].tolist() == [0.0] * 3 and out[1, 4:].tolist() == [0.0] * 2
