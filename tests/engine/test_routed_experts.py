"""Routed experts on a mixture-of-experts model (`builtin:tiny-moe`, a random Qwen3-MoE with a
dense middle layer): generation returns the routing a plain transformers forward takes,
scoring replays given routing, and the client replays it in a trainer's own forward. The
independent side: the router's own top-k from `output_router_logits`, and an MoE block that
routes as told, written here (not rlserve_client.moe)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from rlserve_client import tensor_wire
from rlserve_client.moe import Routing, replay_experts
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from app.common.routed_experts import npy_base64
from app.config import Settings
from app.engine.loader import builtin_moe_dir
from app.trajectories.assemble import segments
from app.trajectories.store import Turn
from tests.conftest import (
    assert_close,
    backend_settings,
    forward_log_probs,
    served_app,
    vllm_installed,
)

MOE_LAYERS = (0, 2)  # layer 1 is dense
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]


@pytest.fixture(scope="module")
def moe_settings(settings: Settings) -> Settings:
    return settings.replace(models={"model": "builtin:tiny-moe"})


@pytest.fixture(scope="module")
async def moe(moe_settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    async with served_app(moe_settings) as client:
        yield client


@pytest.fixture(scope="module")
def hf_moe(moe_settings: Settings) -> torch.nn.Module:
    path: Path = builtin_moe_dir(moe_settings.models)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
async def generated(moe: httpx.AsyncClient) -> list[dict[str, Any]]:
    body = {
        "tokens": PROMPTS,
        "max_new_tokens": 10,
        "n": 2,
        "seed": 3,
        "ignore_eos": True,
        "return_routed_experts": True,
    }
    reply = await moe.post("/v1/generate", json=body)
    assert reply.status_code == 200, reply.text
    return [sample for group in reply.json()["outputs"] for sample in group]


@torch.inference_mode()
def router_choices(model: torch.nn.Module, ids: list[int]) -> dict[int, torch.Tensor]:
    """Per MoE layer, the router's own top-k experts for each token of a plain forward."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    probs = [logits.float().softmax(-1) for logits in out.router_logits]
    return {layer: p.topk(2, dim=-1).indices for layer, p in zip(MOE_LAYERS, probs, strict=True)}


@contextlib.contextmanager
def routed_as(experts: torch.Tensor) -> Iterator[None]:
    """Every Qwen3-MoE block routes token t (of a batch of one) to experts[t, layer] (past
    them, to its own choice) with weights renormalised from its router's softmax, as Qwen3-MoE
    weighs its own choices."""
    original = Qwen3MoeSparseMoeBlock.forward
    layer_of: dict[int, int] = {}

    def forward(self: Qwen3MoeSparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
        layer = layer_of.setdefault(id(self), MOE_LAYERS[len(layer_of)])
        flat = hidden.view(-1, hidden.shape[-1])
        logits = torch.nn.functional.linear(flat, self.gate.weight)
        probs = logits.float().softmax(-1)
        chosen = probs.topk(2, dim=-1).indices  # the last token's own (no routing is given)
        chosen[: len(experts)] = experts[: len(chosen), layer]
        weights = probs.gather(-1, chosen)
        weights = (weights / weights.sum(-1, keepdim=True)).to(flat.dtype)
        return self.experts(flat, chosen, weights).view_as(hidden)

    Qwen3MoeSparseMoeBlock.forward = forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        Qwen3MoeSparseMoeBlock.forward = original  # type: ignore[method-assign]


def shifted(routed: list[Any]) -> torch.Tensor:
    """Another routing: each MoE layer's experts moved to the next ids."""
    experts = torch.tensor(routed)
    for layer in MOE_LAYERS:
        experts[:, layer] = (experts[:, layer] + 1) % 8
    return experts


async def test_generation_returns_the_routing_of_every_fed_token(
    generated: list[dict[str, Any]], hf_moe: torch.nn.Module
) -> None:
    for sample in generated:
        full = sample["tokens"]["full"]
        routed = torch.tensor(sample["routed_experts"])
        assert routed.shape == (len(full) - 1, 3, 2)  # every token but the last, 3 layers, top 2
        assert not routed[:, 1].any()  # the dense layer
        own = router_choices(hf_moe, full)
        for layer in MOE_LAYERS:
            assert torch.equal(routed[:, layer], own[layer][:-1]), layer


async def test_scoring_replays_the_routing_it_is_given(
    moe: httpx.AsyncClient, generated: list[dict[str, Any]], hf_moe: torch.nn.Module
) -> None:
    sample = generated[0]
    full = sample["tokens"]["full"]
    other = shifted(sample["routed_experts"])
    body = {"tokens": [full, full], "routed_experts": [sample["routed_experts"], other.tolist()]}
    reply = await moe.post("/v1/logprobs", json=body)
    assert reply.status_code == 200, reply.text
    replayed, moved = (o["log_probs"]["full"] for o in reply.json()["outputs"])
    num_prompt = len(sample["tokens"]["prompt"])
    sampled = sample["log_probs"]["response"]
    assert max(abs(a - b) for a, b in zip(replayed[num_prompt:], sampled, strict=True)) < 1e-5
    with torch.inference_mode(), routed_as(other):
        logits = hf_moe(torch.tensor([full])).logits[0, :-1].log_softmax(-1)
    expected = logits.gather(-1, torch.tensor(full[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(moved[1:]), expected, atol=1e-5)
    assert (torch.tensor(moved[1:]) - torch.tensor(replayed[1:])).abs().max() > 0.1


async def test_the_client_replays_a_sampled_routing_in_a_trainers_forward(
    generated: list[dict[str, Any]], hf_moe: torch.nn.Module
) -> None:
    """A left-padded batch of two samples of different lengths, routed as they were sampled
    (T - 1 rows each), in a plain transformers forward."""
    rows = [generated[0], generated[2]]
    fulls = [s["tokens"]["full"] for s in rows]
    width = max(len(f) for f in fulls)
    ids = torch.zeros((2, width), dtype=torch.long)
    mask = torch.zeros((2, width), dtype=torch.long)
    for i, full in enumerate(fulls):
        ids[i, width - len(full) :] = torch.tensor(full)
        mask[i, width - len(full) :] = 1
    # the first as rlserve's JSON gives it, the second flat, as AReaL keeps SGLang's
    given = [rows[0]["routed_experts"], np.array(rows[1]["routed_experts"]).reshape(-1, 3 * 2)]
    with torch.inference_mode(), replay_experts(hf_moe, given):
        logits = hf_moe(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
    for i, sample in enumerate(rows):
        response = sample["tokens"]["response"]
        at = torch.arange(width - len(response) - 1, width - 1)
        got = logits[i, at].gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
        sampled = torch.tensor(sample["log_probs"]["response"])
        assert torch.allclose(got, sampled, atol=1e-5)


async def test_routed_experts_travel_as_tensors(moe: httpx.AsyncClient) -> None:
    body = {"tokens": PROMPTS, "max_new_tokens": 4, "seed": 1, "return_routed_experts": True}
    as_json = (await moe.post("/v1/generate", json=body)).json()
    binary = await moe.post("/v1/generate", json=body, headers={"accept": tensor_wire.MEDIA_TYPE})
    decoded = tensor_wire.decode(binary.content)
    for group_json, group in zip(as_json["outputs"], decoded["outputs"], strict=True):
        routed = group[0]["routed_experts"]
        assert isinstance(routed, torch.Tensor) and routed.dim() == 3
        assert routed.tolist() == group_json[0]["routed_experts"]


@pytest.mark.parametrize(
    ("routed", "param", "says"),
    [
        ([[[0, 1], [0, 0], [9, 1]]] * 2, "routed_experts[0]", "expert id 9 is outside [0, 8)"),
        ([[[0, 1], [0, 0]]] * 2, "routed_experts[0]", "each token needs 3 layers x 2 experts"),
        ([[[0, 1], [0, 0], [1, 2]]] * 5, "routed_experts[0]", "5 tokens' routing for a"),
    ],
)
async def test_routing_that_does_not_fit_the_model_is_refused_by_name(
    moe: httpx.AsyncClient, routed: list[Any], param: str, says: str
) -> None:
    reply = await moe.post("/v1/logprobs", json={"tokens": [[1, 2, 3]], "routed_experts": [routed]})
    assert reply.status_code == 422
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error


async def test_a_dense_model_refuses_routed_experts_by_name(client: httpx.AsyncClient) -> None:
    generate = await client.post(
        "/v1/generate",
        json={"tokens": [[1, 2]], "max_new_tokens": 2, "return_routed_experts": True},
    )
    score = await client.post(
        "/v1/logprobs", json={"tokens": [[1, 2]], "routed_experts": [[[[0, 1]]]]}
    )
    env = {"dataset": "arithmetic", "reward": "none", "batch_size": 1, "max_turns": 1}
    rollout = await client.post(
        "/v1/rollouts",
        json={"env": env, "num_episodes": 1, "generation": {"return_routed_experts": True}},
    )
    for reply, param in (
        (generate, "return_routed_experts"),
        (score, "routed_experts"),
        (rollout, "generation.return_routed_experts"),
    ):
        assert reply.status_code == 422, reply.text
        error = reply.json()["error"]
        assert error["param"] == param, error
        assert "not a mixture-of-experts model" in error["message"] or "backend" in error["message"]


async def test_sglang_generate_returns_routed_experts_as_sglang_encodes_them(
    moe: httpx.AsyncClient, hf_moe: torch.nn.Module
) -> None:
    """SGLang's meta_info.routed_experts: base64 of int32 bytes, no shape (slime and AReaL
    reshape them to [tokens, layers, top_k]), from routed_experts_start_len on."""
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_routed_experts": True,
        "routed_experts_start_len": 2,
    }
    reply = await moe.post("/generate", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
    full = PROMPTS[0] + out["output_ids"]
    routed = torch.from_numpy(raw.copy()).long().reshape(len(full) - 1 - 2, 3, 2)
    own = router_choices(hf_moe, full)
    for layer in MOE_LAYERS:
        assert torch.equal(routed[:, layer], own[layer][2:-1])
    past = await moe.post("/generate", json={**body, "routed_experts_start_len": 8})
    assert past.status_code == 422
    assert past.json()["error"]["param"] == "routed_experts_start_len"


async def test_batch_invariant_sampled_log_probs_are_those_of_the_replayed_routing(
    moe: httpx.AsyncClient,
) -> None:
    """In batch-invariant mode, a row's sampled log-probs are /v1/logprobs' of its tokens with
    its routed experts replayed, bitwise."""
    body = {
        "tokens": PROMPTS,
        "max_new_tokens": 8,
        "seed": 5,
        "ignore_eos": True,
        "return_routed_experts": True,
        "batch_invariant": True,
    }
    reply = await moe.post("/v1/generate", json=body)
    assert reply.status_code == 200, reply.text
    samples = [group[0] for group in reply.json()["outputs"]]
    score = {
        "tokens": [s["tokens"]["full"] for s in samples],
        "routed_experts": [s["routed_experts"] for s in samples],
        "batch_invariant": True,
    }
    scored = (await moe.post("/v1/logprobs", json=score)).json()["outputs"]
    for sample, output in zip(samples, scored, strict=True):
        num_prompt = len(sample["tokens"]["prompt"])
        assert output["log_probs"]["full"][num_prompt:] == sample["log_probs"]["response"]


async def test_vllm_generate_carries_routed_experts_as_vllm_encodes_them(
    moe_settings: Settings, hf_moe: torch.nn.Module
) -> None:
    """With --enable-return-routed-experts, each /inference/v1/generate choice carries its
    routing as vLLM's: base64 of a .npy file (uint8 ids for up to 256 experts), from
    routed_experts_prompt_start on."""
    configured = moe_settings.replace(models={"return_routed_experts": True})
    params = {"max_tokens": 5, "temperature": 0, "ignore_eos": True}
    async with served_app(configured) as server:
        reply = await server.post(
            "/inference/v1/generate",
            json={
                "token_ids": PROMPTS[1],
                "sampling_params": {**params, "routed_experts_prompt_start": 1},
            },
        )
        past = await server.post(
            "/inference/v1/generate",
            json={
                "token_ids": PROMPTS[1],
                "sampling_params": {**params, "routed_experts_prompt_start": 9},
            },
        )
        # the start is checked against the prompt the model sees (truncated to its last 2)
        truncated = await server.post(
            "/inference/v1/generate",
            json={
                "token_ids": PROMPTS[1],
                "sampling_params": {
                    **params,
                    "truncate_prompt_tokens": 2,
                    "routed_experts_prompt_start": 3,
                },
            },
        )
        completion = {"prompt": PROMPTS[1], "return_token_ids": True, **params}
        plain = await server.post("/v1/completions", json=completion)
        streamed = await server.post("/v1/completions", json={**completion, "stream": True})
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    array = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
    full = PROMPTS[1] + choice["token_ids"]
    assert array.dtype == np.uint8 and array.shape == (len(full) - 2, 3, 2)
    own = router_choices(hf_moe, full)
    for layer in MOE_LAYERS:
        assert torch.equal(torch.from_numpy(array[:, layer]).long(), own[layer][1:-1])
    # the OpenAI routes' choices carry it too (a stream's last chunk), from the prompt's start
    (choice,) = plain.json()["choices"]
    assert choice["token_ids"] == full[len(PROMPTS[1]) :]
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line[6:7] == "{"]
    carried = [
        c["choices"][0]["routed_experts"] for c in chunks if c["choices"][0].get("routed_experts")
    ]
    assert carried == [choice["routed_experts"]]
    array = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])), allow_pickle=False)
    for layer in MOE_LAYERS:
        assert torch.equal(torch.from_numpy(array[:, layer]).long(), own[layer][:-1])
    for refused in (past, truncated):
        assert refused.status_code in (400, 422), refused.text
        assert refused.json()["error"]["param"] == "sampling_params.routed_experts_prompt_start"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_vllm_serves_the_moe_model_and_refuses_routing_by_name(
    moe_settings: Settings, hf_moe: torch.nn.Module
) -> None:
    """vLLM's CPU build serves the Qwen3-MoE model (scores as transformers computes them), and
    the vLLM backend refuses routed experts by name: vLLM 0.32 captures routing only in its
    V2 model runner, which needs Triton (not in the CPU build), and takes none to replay."""
    configured = backend_settings(moe_settings, "vllm")
    async with served_app(configured, timeout=300) as server:
        sequence = PROMPTS[0] + [12, 13, 14]
        scored = await server.post("/v1/logprobs", json={"tokens": [sequence]})
        asks = await server.post(
            "/v1/generate",
            json={"tokens": [PROMPTS[0]], "max_new_tokens": 2, "return_routed_experts": True},
        )
        replay = await server.post(
            "/v1/logprobs",
            json={"tokens": [sequence], "routed_experts": [[[[0, 1], [0, 0], [1, 2]]] * 9]},
        )
    assert scored.status_code == 200, scored.text
    expected = forward_log_probs(hf_moe, sequence)
    assert_close(scored.json()["outputs"][0]["log_probs"]["full"], expected, 1e-4)
    for reply, param in ((asks, "return_routed_experts"), (replay, "routed_experts")):
        assert reply.status_code == 422, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "the vllm backend" in error["message"], error


async def test_rollouts_return_each_steps_routed_experts(
    moe: httpx.AsyncClient, hf_moe: torch.nn.Module
) -> None:
    """/v1/rollouts with return_routed_experts: each step's routing over its tokens.full (the
    observation and the reply), as a plain forward routes them."""
    body = {
        "env": {"dataset": "arithmetic", "reward": "none", "batch_size": 2, "max_turns": 2},
        "num_episodes": 2,
        "generation": {"max_new_tokens": 4, "seed": 2, "return_routed_experts": True},
    }
    reply = await moe.post("/v1/rollouts", json=body)
    assert reply.status_code == 200, reply.text
    steps = [step for t in reply.json()["trajectories"] for step in t["steps"]]
    assert steps
    for step in steps:
        full = step["tokens"]["full"]
        routed = torch.tensor(step["routed_experts"])
        assert routed.shape == (len(full) - 1, 3, 2)
        own = router_choices(hf_moe, full)
        for layer in MOE_LAYERS:
            assert torch.equal(routed[:, layer], own[layer][:-1])


async def test_recorded_trajectories_keep_each_turns_routing(
    moe_settings: Settings, moe: httpx.AsyncClient, hf_moe: torch.nn.Module
) -> None:
    """With --enable-return-routed-experts, a trajectory recorded by the OpenAI routes keeps
    its turns' routing: each segment's routed_experts covers its tokens but the last, every
    token routed as the turn that first fed it routed it (as a plain forward of that turn's
    tokens does), and replaying it scores the sampled tokens as they were sampled. A server
    without the flag records none."""
    configured = moe_settings.replace(models={"return_routed_experts": True})
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    turns: list[list[int]] = []  # each turn's prompt + completion
    async with served_app(configured) as server:
        prompts = [PROMPTS[0], None, PROMPTS[1]]  # turn 1 extends turn 0; turn 2 breaks off
        for prompt in prompts:
            prompt = prompt if prompt is not None else [*turns[-1], 12, 13]
            body = {"prompt": prompt, "trajectory_id": "moe", **params}
            reply = await server.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            turns.append(prompt + reply.json()["choices"][0]["token_ids"])
        recorded = (await server.get("/v1/trajectories/moe")).json()
        first, second = recorded["segments"]
        replayed = await server.post(
            "/v1/logprobs",
            json={"tokens": [first["tokens"]["full"]], "routed_experts": [first["routed_experts"]]},
        )
    assert first["tokens"]["full"] == turns[1] and second["tokens"]["full"] == turns[2]
    for segment, fed_by in ((first, [turns[0], turns[1]]), (second, [turns[2]])):
        routed = torch.tensor(segment["routed_experts"])
        assert routed.shape == (len(segment["tokens"]["full"]) - 1, 3, 2)
        start = 0
        for tokens in fed_by:  # rows [start, len(tokens) - 1) were first fed by this turn
            own = router_choices(hf_moe, tokens)
            for layer in MOE_LAYERS:
                assert torch.equal(
                    routed[start:, layer][: len(tokens) - 1 - start], own[layer][start:-1]
                )
            start = len(tokens) - 1
    # the sampled tokens' recorded log-probs are what the recorded routing gives
    assert replayed.status_code == 200, replayed.text
    scored = replayed.json()["outputs"][0]["log_probs"]["full"]
    sampled = [i for i, m in enumerate(first["masks"]["all_assistant_mask"]) if m]
    assert_close(
        [first["log_probs"]["full"][i] for i in sampled], [scored[i] for i in sampled], 1e-5
    )
    body = {"prompt": PROMPTS[0], "trajectory_id": "dense-flag-off", **params}
    assert (await moe.post("/v1/completions", json=body)).status_code == 200
    (segment,) = (await moe.get("/v1/trajectories/dense-flag-off")).json()["segments"]
    assert "routed_experts" not in segment


def test_a_segments_routing_takes_each_token_from_the_turn_that_fed_it_first(
    hf_moe: torch.nn.Module,
) -> None:
    """Turn 1 re-feeds turn 0's tokens with other routing: the segment keeps turn 0's for them
    (the routing turn 0's samples were drawn with) and turn 1's for the rest; a turn kept
    without routing leaves its segment without any."""
    routing = Routing(hf_moe)
    routing.close()

    def turn(prompt: list[int], completion: list[int], expert: int | None) -> Turn:
        rows = torch.full((len(prompt) + len(completion) - 1, 3, 2), expert or 0)
        encoded = None if expert is None else npy_base64(rows, routing)
        return Turn(prompt, completion, [0.0] * len(completion), [], "stop", "policy", 0.0, encoded)

    first = turn([1, 2, 3], [4, 5], 1)
    second = turn([1, 2, 3, 4, 5, 6], [7, 8, 9], 2)
    (segment,) = segments([first, second])
    got = segment.routed_experts
    assert got is not None and got.shape == (8, 3, 2)
    assert got[:4].tolist() == torch.full((4, 3, 2), 1).tolist()  # tokens 1-4: turn 0 fed them
    assert got[4:].tolist() == torch.full((4, 3, 2), 2).tolist()  # tokens 5-8: turn 1
    (unrouted,) = segments([first, turn([1, 2, 3, 4, 5, 6], [7], None)])
    assert unrouted.routed_experts is None


async def test_a_generation_across_a_weight_change_keeps_the_routing_each_token_was_sampled_with(
    moe_settings: Settings, hf_moe: torch.nn.Module
) -> None:
    """New weights arrive mid-generation (keep mode: the cache is rebuilt under them): the
    tokens fed before keep the old weights' routing, which sampled the tokens after them, and
    the rest have the new weights', each as a plain forward of that model routes them."""
    from tests.weights.conftest import Served
    from tests.weights.test_pause import in_flight

    other_dir = builtin_moe_dir(moe_settings.replace(models={"builtin_seed": 1}).models)
    other = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    configured = moe_settings.replace(limits={"max_new_tokens": 2000})
    body = {
        "tokens": [PROMPTS[0]],
        "max_new_tokens": 1500,
        "ignore_eos": True,
        "seed": 4,
        "return_routed_experts": True,
    }
    async with served_app(configured, timeout=120) as server:
        served = Served(server.app, server, asyncio.get_running_loop())  # type: ignore[attr-defined]
        generation = await in_flight(served, body)
        pushed = await server.put("/v1/weights", content=save(other.state_dict()))  # fused
        reply = await generation
    assert pushed.status_code == 200, pushed.text
    assert reply.status_code == 200, reply.text
    (sample,) = reply.json()["outputs"][0]
    spans = sample["policy_versions"]
    assert [s["version"] for s in spans] == [0, 1], spans
    k = spans[1]["start"]  # the first response token the new weights sampled
    assert 0 < k < 1500
    full = sample["tokens"]["full"]
    cut = len(PROMPTS[0]) + k - 1  # the row its distribution was computed at
    routed = torch.tensor(sample["routed_experts"])
    assert routed.shape == (len(full) - 1, 3, 2)
    old, new = router_choices(hf_moe, full), router_choices(other, full)
    for layer in MOE_LAYERS:
        assert torch.equal(routed[:cut, layer], old[layer][:cut])
        assert torch.equal(routed[cut:, layer], new[layer][cut:-1])
        assert not torch.equal(old[layer][:cut], new[layer][:cut])  # the two differ there


async def test_the_moe_policy_takes_the_checkpoints_per_expert_tensors(
    moe_settings: Settings, hf_moe: torch.nn.Module
) -> None:
    """transformers fuses each layer's experts; trainers exporting for vLLM or SGLang push the
    hub's per-expert tensors (what save_pretrained writes). Both an upload and the collective
    transfer of those serve the new weights exactly, and a restore the starting ones."""
    from tests.weights.conftest import Served
    from tests.weights.test_transfer import send

    seeds = [
        builtin_moe_dir(moe_settings.replace(models={"builtin_seed": s}).models) for s in (1, 2)
    ]
    written = [load_file(d / "model.safetensors") for d in seeds]
    assert any(".experts.0.gate_proj.weight" in name for name in written[0])  # the hub's names
    async with served_app(moe_settings, timeout=120) as server:
        served = Served(server.app, server, asyncio.get_running_loop())  # type: ignore[attr-defined]
        uploaded = await server.put("/v1/weights", content=save(written[0]))
        assert uploaded.status_code == 200, uploaded.text
        after_upload = await served.scores(PROMPTS)
        sent = await asyncio.to_thread(send, served, written[1])
        assert sent.num_tensors == len(written[1])
        after_transfer = await served.scores(PROMPTS)
        restored = await server.post("/v1/weights/restore", json={})
        assert restored.status_code == 200, restored.text
        after_restore = await served.scores(PROMPTS)
    for prompt, got in zip(PROMPTS, after_restore, strict=True):  # the starting weights again
        assert_close(got, forward_log_probs(hf_moe, prompt), 1e-5)
    for directory, scores in zip(seeds, (after_upload, after_transfer), strict=True):
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        for prompt, got in zip(PROMPTS, scores, strict=True):
            assert_close(got, forward_log_probs(model, prompt), 1e-5)
