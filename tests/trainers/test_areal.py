"""AReaL 1.0.4's own remote SGLang engine (`areal.engine.sglang_remote.RemoteSGLangEngine`,
from its PyPI release, unmodified) against a real rlserve: generation with the stop ids its
workflows send ([pad, eos]), the log-probs it parses against /v1/logprobs, pause and continue,
weight updates over gloo as its trainer broadcasts them, and a three-step loop that ends with
the server serving the trainer's weights. Runs in .venv-trainers (scripts/test-trainers.sh)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist
from rlserve_client.moe import replay_experts

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import free_port, running_server
from tests.e2e.trainer import grpo_step, learn, policy_server

pytestmark = pytest.mark.trainers
remote = pytest.importorskip("areal.engine.sglang_remote", reason="AReaL is not installed")

from areal.api.alloc_mode import ModelAllocation  # noqa: E402
from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig  # noqa: E402
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta  # noqa: E402
from areal.engine.core.distributed import init_custom_process_group  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    with policy_server(tmp_path_factory.mktemp("areal")) as running:
        yield running


@pytest.fixture(scope="module")
def engine(server):  # type: ignore[no-untyped-def]
    engine = remote.RemoteSGLangEngine(
        InferenceEngineConfig(backend="sglang:d1", request_timeout=120, setup_timeout=120)
    )
    engine.initialize(addr=server.url.removeprefix("http://"))
    yield engine
    engine.destroy()


def served_model(url: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    source = httpx.get(f"{url}/v1/models").json()["data"][0]["source"]
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def stop_ids(url: str) -> list[int]:
    """What AReaL's workflows send: `GenerationHyperparameters.new_with_stop_and_pad_token_ids`
    of the policy's tokenizer ([pad, eos], or [eos] where they are one token)."""
    from transformers import AutoTokenizer

    source = httpx.get(f"{url}/v1/models").json()["data"][0]["source"]
    tokenizer = AutoTokenizer.from_pretrained(source)
    config = GenerationHyperparameters(max_new_tokens=8).new_with_stop_and_pad_token_ids(tokenizer)
    return list(config.stop_token_ids)


def generate(engine: Any, prompt: list[int], **gconfig: Any) -> Any:
    request = ModelRequest(input_ids=prompt, gconfig=GenerationHyperparameters(**gconfig))
    return asyncio.run(engine.agenerate(request))


def served_log_probs(url: str, sequences: list[list[int]]) -> list[list[float]]:
    body = httpx.post(f"{url}/v1/logprobs", json={"tokens": sequences}, timeout=60).json()
    return [output["log_probs"]["full"] for output in body["outputs"]]


def test_areal_generates_and_its_log_probs_are_the_servers(server, engine):
    stops = stop_ids(server.url)
    assert len(stops) >= 1
    prompt = [5, 6, 7, 8]
    for greedy in (True, False):
        reply = generate(
            engine, prompt, max_new_tokens=8, stop_token_ids=stops, greedy=greedy, temperature=1.0
        )
        assert reply.input_tokens == prompt and 1 <= len(reply.output_tokens) <= 8
        assert reply.stop_reason in ("stop", "length")
        if reply.stop_reason == "stop":
            assert reply.output_tokens[-1] in stops
        (full,) = served_log_probs(server.url, [prompt + reply.output_tokens])
        assert_close(reply.output_logprobs, full[len(prompt) :], 1e-4)


def test_areal_pauses_and_continues_generation(server, engine):
    engine.pause_generation()
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": True}
    engine.continue_generation()
    assert httpx.get(f"{server.url}/is_paused").json() == {"is_paused": False}


@pytest.fixture(scope="module")
def group(engine):  # type: ignore[no-untyped-def]
    """The trainer joins the server's group once, as rank 0 beside the server's init, as
    AReaL's FSDP engine does at its start (gloo, as AReaL picks on a machine without CUDA)."""
    meta = WeightUpdateMeta(
        type="xccl",
        gen_allocation=ModelAllocation.from_str("sglang:d1"),
        nccl_master_address="127.0.0.1",
        nccl_master_port=free_port(),
        nccl_group_name="update_weight_group",
    )
    joined: Future[Any] = engine.init_weights_update_group(meta)
    process_group = init_custom_process_group(
        backend="gloo",
        world_size=2,
        init_method=f"tcp://127.0.0.1:{meta.nccl_master_port}",
        rank=0,
        group_name="update_weight_group",
    )
    joined.result()
    yield meta, process_group
    dist.destroy_process_group(process_group)


def push(engine: Any, group: Any, model: torch.nn.Module) -> None:
    """AReaL's distributed update: per bucket, the update request beside one broadcast per
    tensor, in the bucket's order; the server paused around it, as AReaL's loop does."""
    meta, process_group = group
    named = [(name, p.detach().contiguous()) for name, p in model.named_parameters()]
    engine.pause_generation()
    for bucket in (named[: len(named) // 2], named[len(named) // 2 :]):
        specs = [
            ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split(".")[-1])
            for n, t in bucket
        ]
        pending: Future[Any] = engine.update_weights_from_distributed(meta, specs)
        for _, tensor in bucket:
            dist.broadcast(tensor, src=0, group=process_group)
        pending.result()
    engine.continue_generation()


def test_areal_pushes_weights_that_are_then_served(server, engine, group):
    model = served_model(server.url)
    learn(model, seed=5)
    before = httpx.get(f"{server.url}/v1/weights/version").json()["policy_version"]
    push(engine, group, model)
    assert httpx.get(f"{server.url}/v1/weights/version").json()["policy_version"] > before
    sequences = [[5, 6, 7, 8, 9, 10], [100, 101, 102, 103]]
    for seq, got in zip(sequences, served_log_probs(server.url, sequences), strict=True):
        assert_close(got, forward_log_probs(model, seq), 1e-4)


def test_an_areal_grpo_loop_ends_serving_the_trainers_weights(server, engine, group):
    """Three GRPO steps as AReaL's loop runs them: groups generated through its engine with
    its stop ids, a step on the trainer's model, a paused distributed push; the served
    weights are then the trainer's."""
    model = served_model(server.url)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    stops = stop_ids(server.url)
    prompts = [[5, 6, 7], [40, 41]]
    for _step in range(3):
        groups = []
        for prompt in prompts:
            replies = [
                generate(engine, prompt, max_new_tokens=4, stop_token_ids=stops) for _ in range(4)
            ]
            completions = [r.output_tokens for r in replies]
            rewards = [float(sum(t % 2 == 0 for t in c)) for c in completions]
            groups.append((prompt, completions, rewards))
        grpo_step(model, optimizer, groups)
        push(engine, group, model)
    sequences = [[5, 6, 7, 8, 9], [40, 41, 42]]
    for seq, got in zip(sequences, served_log_probs(server.url, sequences), strict=True):
        assert_close(got, forward_log_probs(model, seq), 1e-4)


def test_areal_reads_the_routed_experts_of_a_moe_policy(tmp_path_factory):
    """AReaL's engine with return_routed_experts, on a mixture-of-experts policy: its own parser
    reads SGLang's meta_info.routed_experts ([prompt + output - 1, layers * top_k]); they are
    the experts a plain forward routes the tokens to, and /v1/logprobs replaying them gives
    AReaL's log-probs back."""
    tmp = tmp_path_factory.mktemp("areal-moe")
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_MODELS__MODEL": "builtin:tiny-moe",
    }
    with running_server(env=env, log=tmp / "server.log") as server:
        config = InferenceEngineConfig(
            backend="sglang:d1", request_timeout=120, setup_timeout=120, return_routed_experts=True
        )
        engine = remote.RemoteSGLangEngine(config)
        engine.initialize(addr=server.url.removeprefix("http://"))
        try:
            prompt = [5, 6, 7, 8, 9]
            reply = generate(engine, prompt, max_new_tokens=6, greedy=False, temperature=1.0)
        finally:
            engine.destroy()
        full = prompt + reply.output_tokens
        routed = torch.from_numpy(reply.routed_experts.copy()).long().view(len(full) - 1, 3, 2)
        body = {"tokens": [full], "routed_experts": [routed.tolist()]}
        scored = httpx.post(f"{server.url}/v1/logprobs", json=body, timeout=60).json()
        model = served_model(server.url)
    with torch.inference_mode():
        out = model(torch.tensor([full]), output_router_logits=True)
    for layer, logits in zip((0, 2), out.router_logits, strict=True):  # layer 1 is dense
        own = logits.float().softmax(-1).topk(2, dim=-1).indices[:-1]
        assert torch.equal(routed[:, layer], own)
    replayed = scored["outputs"][0]["log_probs"]["full"][len(prompt) :]
    assert_close(reply.output_logprobs, replayed, 1e-5)
    # the trainer's own forward, routed as AReaL keeps the routing ([rows, layers * top_k])
    with torch.inference_mode(), replay_experts(model, [reply.routed_experts]):
        logits = model(torch.tensor([full])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    local = logits.gather(-1, torch.tensor(reply.output_tokens)[:, None]).squeeze(-1)
    assert_close(reply.output_logprobs, local.tolist(), 1e-5)
