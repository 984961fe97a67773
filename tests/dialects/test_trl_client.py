"""TRL's own `VLLMClient` (the PyPI release, unmodified) against a real rlserve server, and a
trainer built from vLLM's own trainer-side pieces (its stateless gloo group, its HTTP weight-sync
client, its packing) pushing weights the way TRL's client does on a GPU. Runs in the vLLM
suite: TRL's client refuses to start without vllm installed."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.distributed as dist

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import free_port
from tests.e2e.trainer import grpo_step, learn, policy_server

pytestmark = [
    pytest.mark.vllm,
    # TRL 1.16 names vLLM 0.31 as its newest; we pin 0.32 (its routes are the same).
    pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions"),
]
trl_client = pytest.importorskip("trl.generation.vllm_client", reason="TRL is not installed")
packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import os

    tmp = tmp_path_factory.mktemp("trl")
    os.environ["RLSERVE_LIMITS__MAX_TOP_LOGPROBS"] = "128"  # TRL asks for 100 by default
    try:
        with policy_server(tmp) as running:
            yield running
    finally:
        del os.environ["RLSERVE_LIMITS__MAX_TOP_LOGPROBS"]


def served_model(url: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    source = httpx.get(f"{url}/v1/models").json()["data"][0]["source"]
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def test_trl_generates_scores_and_controls_through_rlserve(server):
    client = trl_client.VLLMClient(base_url=server.url, connection_timeout=60)
    assert client.model == "policy"
    prompts = [[5, 6, 7, 8], [100, 101, 102]]
    out = client.generate(prompts, n=2, max_tokens=5, temperature=1.0, logprobs=2)
    assert out["prompt_ids"] == prompts
    assert len(out["completion_ids"]) == 4
    model = served_model(server.url)
    for k, ids in enumerate(out["completion_ids"]):
        full = prompts[k // 2] + ids
        own = forward_log_probs(model, full)[len(prompts[k // 2]) :]
        sampled = [
            row[0] if row_ids[0] == t else None
            for row, row_ids, t in zip(
                out["logprobs"][k], out["logprob_token_ids"][k], ids, strict=True
            )
        ]
        for got, want, row, row_ids, t in zip(
            sampled, own, out["logprobs"][k], out["logprob_token_ids"][k], ids, strict=True
        ):
            # TRL sorts the sampled token in among the top ones: find it by id.
            assert t in row_ids
            assert abs(row[row_ids.index(t)] - want) < 1e-4, (got, want)
    chat = client.chat([[{"role": "user", "content": "Hi there"}]], max_tokens=4, logprobs=0)
    assert len(chat["completion_ids"]) == 1 and len(chat["prompt_ids"][0]) > 3
    sequences = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103]]
    scored = client.get_sequence_logprobs(sequences, prompt_lengths=[2, 1], top_logprobs=100)
    for seq, start, actual in zip(sequences, [2, 1], scored["actual_logprobs"], strict=True):
        want = forward_log_probs(model, seq)[start:]
        assert_close([row[0] if isinstance(row, list) else row for row in actual], want, 1e-4)
    assert client.get_world_size() == 1
    client.reset_prefix_cache()
    assert client.get_server_info()["weight_transfer_config"]["backend"] == "gloo"


def push(url: str, model: torch.nn.Module, version: str) -> None:
    """TRL's weight sync on a GPU, step for step, with vLLM's gloo group in place of NCCL:
    init (beside the rendezvous), start, update (beside the packed broadcasts), finish."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    server_url = url
    world = httpx.get(f"{server_url}/get_world_size").json()["world_size"] + 1
    port = free_port()
    sync = HTTPVLLMWeightSyncClient(server_url)
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 17,
    }
    tensors = [(name, p.detach()) for name, p in model.named_parameters()]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(sync.init_weight_transfer_engine, init_info)
        group = stateless_init_torch_distributed_process_group("127.0.0.1", port, 0, world, "gloo")
        joined.result()
        update_info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        sync.start_weight_update()
        pending = pool.submit(sync.update_weights, update_info)
        stream = iter(tensors)
        options = dist.BroadcastOptions()
        options.rootRank = 0
        while (
            chunk := packed_tensor.pack_tensors(stream, lambda item: item[1], 1 << 17)
        ) is not None:
            group.broadcast([chunk.packed_tensor], options).wait()
        pending.result()
        sync.finish_weight_update(weight_version=version)
        sync.shutdown_weight_transfer_engine()


def test_vllms_trainer_pieces_push_weights_that_are_then_served(server):
    model = served_model(server.url)
    learn(model, seed=3)
    push(server.url, model, "7")
    assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": "7"}
    sequences = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103]]
    body = httpx.post(f"{server.url}/v1/logprobs", json={"tokens": sequences}).json()
    for seq, output in zip(sequences, body["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(model, seq), 1e-4)
    assert not any(math.isnan(v) for o in body["outputs"] for v in o["log_probs"]["full"])


def test_a_trl_grpo_loop_ends_serving_the_trainers_weights(server):
    """Three GRPO steps as TRL's GRPOTrainer drives its server: generate groups through TRL's
    client, score, step, push; the served weights are then the trainer's."""
    client = trl_client.VLLMClient(base_url=server.url, connection_timeout=60)
    model = served_model(server.url)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = int(httpx.get(f"{server.url}/weight_info").json()["weight_version"])
    prompts = [[5, 6, 7], [40, 41]]
    for step in range(1, 4):
        out = client.generate(prompts, n=4, max_tokens=4, logprobs=0)
        groups = []
        for i, prompt in enumerate(prompts):
            completions = out["completion_ids"][i * 4 : (i + 1) * 4]
            rewards = [float(sum(t % 2 == 0 for t in c)) for c in completions]
            groups.append((prompt, completions, rewards))
        grpo_step(model, optimizer, groups)
        push(server.url, model, str(start + step))
    assert httpx.get(f"{server.url}/weight_info").json()["weight_version"] == str(start + 3)
    sequences = [[5, 6, 7, 8, 9], [40, 41, 42]]
    body = httpx.post(f"{server.url}/v1/logprobs", json={"tokens": sequences}).json()
    for seq, output in zip(sequences, body["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(model, seq), 1e-4)
