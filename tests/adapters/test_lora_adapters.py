"""LoRA adapters as policies: what rlserve serves for an adapter equals PEFT's own forward of
the same adapter on the same base (PEFT computes the expected values: an independent
implementation), rows of several adapters and of the base share model calls, and the routes
of rlserve, vLLM and SGLang load, list and unload them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from rlserve_client import AsyncClient, NotFoundError
from safetensors.torch import save
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.engine.types import GenerateItem, SamplingConfig, ScoreSpec
from tests.conftest import forward_log_probs, served_app

SEQUENCES = [[1, 5, 9, 13, 22, 7, 3], [4, 4, 8, 100, 2], [17, 30, 41, 52, 63, 74, 85, 96, 107]]
PROMPT = [3, 14, 15, 92, 65]

ADAPTERS: dict[str, dict[str, Any]] = {
    # attention and MLP layers, rank 4
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    # PEFT's per-layer rank and alpha patterns, rsLoRA scaling
    "mlp": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["gate_proj", "up_proj", "down_proj", "o_proj"],
        "rank_pattern": {"down_proj": 2},
        "alpha_pattern": {"up_proj": 4},
    },
    # another version of "qv": other values, same layout
    "qv-next": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    # PEFT's default initialisation: B is zero, so the adapter changes nothing yet
    "zero": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "init": True},
}


def build_adapter(model_dir: Path, into: Path, seed: int, spec: dict[str, Any]) -> PeftModel:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    options = {k: v for k, v in spec.items() if k != "init"}
    torch.manual_seed(seed)
    config = LoraConfig(**options, init_lora_weights=bool(spec.get("init", False)))
    model = get_peft_model(base, config).eval()
    # (the output head is tied to the embeddings here: PEFT would save them too)
    model.save_pretrained(into, save_embedding_layers=False)
    return model


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Each adapter's folder (as PEFT saves it) and the PeftModel that wrote it."""
    root = tmp_path_factory.mktemp("adapters")
    built = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        built[name] = (root / name, build_adapter(model_dir, root / name, seed, spec))
    return built


@pytest.fixture(scope="module")
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(storage={"data_dir": settings.storage.data_dir / "adapters"})
    async with served_app(config) as c:
        yield c


async def load(client: httpx.AsyncClient, name: str, path: Path) -> dict[str, Any]:
    response = await client.post("/v1/adapters", json={"name": name, "path": str(path)})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def scores(client: httpx.AsyncClient, model: str, sequences: list[list[int]]) -> Any:
    response = await client.post("/v1/logprobs", json={"model": model, "tokens": sequences})
    assert response.status_code == 200, response.text
    return response.json()


def close(actual: list[float], expected: list[float], tol: float = 1e-5) -> bool:
    return len(actual) == len(expected) and all(
        abs(a - e) <= tol for a, e in zip(actual, expected, strict=True)
    )


async def test_an_adapters_log_probs_are_those_of_peft(client, adapters, hf_model):
    for name in ("qv", "mlp"):
        folder, peft_model = adapters[name]
        info = await load(client, name, folder)
        assert info["version"] == 0 and info["base"] == "policy"
        assert info["num_parameters"] == sum(
            p.numel() for n, p in peft_model.named_parameters() if "lora_" in n
        )
        body = await scores(client, name, SEQUENCES)  # mixed lengths: padded together
        assert body["model"] == name and body["policy_version"] == 0
        for sequence, output in zip(SEQUENCES, body["outputs"], strict=True):
            got = output["log_probs"]["full"]
            assert close(got, forward_log_probs(peft_model, sequence))
            # the adapter matters (so the comparison above could fail)
            assert not close(got, forward_log_probs(hf_model, sequence), tol=1e-3)
    # the policy itself is untouched by the adapters it carries
    body = await scores(client, "policy", SEQUENCES)
    for sequence, output in zip(SEQUENCES, body["outputs"], strict=True):
        assert close(output["log_probs"]["full"], forward_log_probs(hf_model, sequence))


async def test_rows_of_several_adapters_and_the_base_share_one_model_call(
    client, adapters, hf_model
):
    registry = client.app.state.registry
    qv, mlp = (await_adapter(registry, "qv", adapters), await_adapter(registry, "mlp", adapters))
    backend = registry.models["policy"].backend
    plan = [qv, None, mlp, qv]
    items = [(seq, ScoreSpec(adapter=a)) for seq, a in zip([*SEQUENCES, PROMPT], plan, strict=True)]
    scored = await backend.score_detailed(items)
    expected_models = {None: hf_model, qv: adapters["qv"][1], mlp: adapters["mlp"][1]}
    for (seq, spec), result in zip(items, scored, strict=True):
        assert close(
            result.log_probs.tolist(), forward_log_probs(expected_models[spec.adapter], seq)
        )

    # one prompt, three rows: each decodes with its own adapter (not one shared prefill)
    config = SamplingConfig(max_new_tokens=8, do_sample=False, ignore_eos=True)
    rows = [GenerateItem(tuple(PROMPT), config, seed=0, adapter=a) for a in (qv, mlp, None)]
    generations = await backend.generate(rows)
    assert len({tuple(g.token_ids) for g in generations}) > 1
    for row, generation in zip(rows, generations, strict=True):
        model = expected_models[row.adapter]
        full = PROMPT + generation.token_ids
        assert close(generation.log_probs, forward_log_probs(model, full)[len(PROMPT) :], 1e-4)
        assert_greedy(model, PROMPT, generation.token_ids)


def await_adapter(registry: Any, name: str, adapters: dict[str, Any]) -> Any:
    assert name in registry.adapters, f"{name} is loaded by the first test"
    return registry.adapters[name]


@torch.inference_mode()
def assert_greedy(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> None:
    """Each token is the most likely one under `model` (up to float noise between ties)."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    for position, token in enumerate(tokens):
        assert logits[position, token] >= logits[position].max() - 1e-4


async def test_every_generation_route_takes_an_adapters_name(client, adapters):
    peft_model = adapters["mlp"][1]
    body = {"model": "mlp", "tokens": [PROMPT], "max_new_tokens": 6, "temperature": 0}
    response = await client.post("/v1/generate", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["model"] == "mlp" and answer["policy_version"] == 0
    tokens = answer["outputs"][0][0]["tokens"]["response"]
    assert_greedy(peft_model, PROMPT, tokens)
    base = await client.post("/v1/generate", json={**body, "model": "policy", "ignore_eos": True})
    assert base.json()["outputs"][0][0]["tokens"]["response"] != tokens

    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    vllm = await client.post(
        "/inference/v1/generate",
        json={"model": "mlp", "token_ids": PROMPT, "sampling_params": params},
    )
    assert vllm.status_code == 200, vllm.text
    assert vllm.json()["choices"][0]["token_ids"] == tokens
    sglang_params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    sglang = await client.post(
        "/generate",
        json={"input_ids": PROMPT, "lora_path": "mlp", "sampling_params": sglang_params},
    )
    assert sglang.status_code == 200, sglang.text
    assert sglang.json()["output_ids"] == tokens
    # one adapter per prompt, as SGLang takes a list
    mixed = await client.post(
        "/generate",
        json={
            "input_ids": [PROMPT, PROMPT],
            "lora_path": ["mlp", None],
            "sampling_params": sglang_params,
        },
    )
    assert mixed.status_code == 200, mixed.text
    assert [o["output_ids"] for o in mixed.json()] == [
        tokens,
        base.json()["outputs"][0][0]["tokens"]["response"],
    ]
    unknown = await client.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
    assert unknown.status_code == 422 and unknown.json()["error"]["param"] == "lora_path"

    chat = await client.post(
        "/v1/completions",
        json={
            "model": "mlp",
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "mlp"


async def test_an_adapters_kl_is_against_its_base_with_the_adapter_off(client, adapters, hf_model):
    kl = await client.post(
        "/v1/kl", json={"model": "qv", "tokens": SEQUENCES, "assistant_only": False}
    )
    assert kl.status_code == 200, kl.text
    for sequence, output in zip(SEQUENCES, kl.json()["outputs"], strict=True):
        policy = forward_log_probs(adapters["qv"][1], sequence)
        reference = forward_log_probs(hf_model, sequence)
        assert close(output["policy_log_probs"], policy)
        assert close(output["ref_log_probs"], reference)
        assert close(
            output["kl"][1:], [p - q for p, q in zip(policy, reference, strict=True)][1:], 2e-5
        )
    # an adapter that changes nothing (PEFT's initialisation: B = 0) has a KL of exactly 0
    await load(client, "zero", adapters["zero"][0])
    kl = await client.post(
        "/v1/kl", json={"model": "zero", "tokens": SEQUENCES, "assistant_only": False}
    )
    assert [o["kl_sum"] for o in kl.json()["outputs"]] == [0.0] * len(SEQUENCES)


async def test_loading_a_name_again_serves_its_next_version(client, adapters):
    folder, _ = adapters["qv"]
    await load(client, "versioned", folder)
    second = await load(client, "versioned", adapters["qv-next"][0])
    assert second["version"] == 1
    body = await scores(client, "versioned", SEQUENCES[:1])
    assert body["policy_version"] == 1
    expected = forward_log_probs(adapters["qv-next"][1], SEQUENCES[0])
    assert close(body["outputs"][0]["log_probs"]["full"], expected)

    listed = (await client.get("/v1/adapters")).json()["adapters"]
    assert [(a["name"], a["version"]) for a in listed if a["name"] == "versioned"] == [
        ("versioned", 1)
    ]
    cards = (await client.get("/v1/models")).json()["data"]
    card = next(c for c in cards if c["id"] == "versioned")
    assert card["parent"] == "policy" and card["root"] == str(adapters["qv-next"][0])

    gone = await client.delete("/v1/adapters/versioned")
    assert gone.status_code == 200 and gone.json()["version"] == 1
    after = await client.post("/v1/logprobs", json={"model": "versioned", "tokens": SEQUENCES})
    assert after.status_code == 404 and after.json()["error"]["param"] == "model"
    again = await client.delete("/v1/adapters/versioned")
    assert again.status_code == 404


async def test_vllms_and_sglangs_adapter_routes(client, adapters):
    folder = str(adapters["qv"][0])
    body = {"lora_name": "from-vllm", "lora_path": folder}
    loaded = await client.post("/v1/load_lora_adapter", json=body)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'from-vllm' added successfully."
    twice = await client.post("/v1/load_lora_adapter", json=body)
    assert twice.status_code == 400 and twice.json()["error"]["param"] == "lora_name"
    inplace = await client.post("/v1/load_lora_adapter", json={**body, "load_inplace": True})
    assert inplace.status_code == 200, inplace.text
    assert client.app.state.registry.adapters["from-vllm"].version == 1
    unloaded = await client.post("/v1/unload_lora_adapter", json={"lora_name": "from-vllm"})
    assert unloaded.text == "Success: LoRA adapter 'from-vllm' removed successfully."
    missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "from-vllm"})
    assert missing.status_code == 404  # ART reads a 404 as "not loaded"
    bad_path = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"}
    )
    assert bad_path.status_code == 404  # prime-rl retries on vLLM's 404

    sglang = await client.post(
        "/load_lora_adapter", json={"lora_name": "from-sglang", "lora_path": folder}
    )
    assert sglang.status_code == 200, sglang.text
    assert sglang.json()["success"] and sglang.json()["loaded_adapters"]["from-sglang"] == folder
    again = await client.post(
        "/load_lora_adapter", json={"lora_name": "from-sglang", "lora_path": folder}
    )
    assert again.status_code == 409 and again.json()["error"]["param"] == "lora_name"
    out = await client.post("/unload_lora_adapter", json={"lora_name": "from-sglang"})
    assert out.status_code == 200 and "from-sglang" not in out.json()["loaded_adapters"]
    # verl refreshes an adapter by unloading and loading it again: its versions go on
    reloaded = await client.post(
        "/load_lora_adapter", json={"lora_name": "from-sglang", "lora_path": folder}
    )
    assert reloaded.status_code == 200
    assert client.app.state.registry.adapters["from-sglang"].version == 1
    tensors = await client.post("/load_lora_adapter_from_tensors", json={})
    assert tensors.status_code == 422


def write_adapter(folder: Path, source: Path, **config_changes: Any) -> Path:
    folder.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **config_changes}))
    (folder / "adapter_model.safetensors").write_bytes(
        (source / "adapter_model.safetensors").read_bytes()
    )
    return folder


async def test_what_cannot_be_served_is_refused_by_name(client, adapters, tmp_path, model_dir):
    source = adapters["qv"][0]

    async def refusal(name: str, path: Path | str) -> tuple[int, dict[str, Any]]:
        response = await client.post("/v1/adapters", json={"name": name, "path": str(path)})
        return response.status_code, response.json()["error"]

    status, error = await refusal("a", tmp_path / "missing")
    assert status == 404 and error["param"] == "path"
    (tmp_path / "empty").mkdir()
    status, error = await refusal("a", tmp_path / "empty")
    assert status == 404 and "adapter_config.json" in error["message"]
    dora = write_adapter(tmp_path / "dora", source, use_dora=True)
    status, error = await refusal("a", dora)
    assert status == 422 and error["param"] == "path" and "use_dora" in error["message"]
    wrong_rank = write_adapter(tmp_path / "rank", source, r=8)
    status, error = await refusal("a", wrong_rank)
    assert status == 422 and "rank 4" in error["message"]
    head = tmp_path / "head"
    build_adapter(model_dir, head, 0, {"r": 2, "lora_alpha": 2, "target_modules": ["lm_head"]})
    status, error = await refusal("a", head)
    assert status == 422 and "lm_head" in error["message"]
    status, error = await refusal("policy", source)
    assert status == 409 and error["param"] == "name"
    assert "a" not in client.app.state.registry.adapters


async def test_the_client_loads_lists_and_unloads_adapters(client, adapters):
    transport = httpx.ASGITransport(app=client.app)
    async with AsyncClient(base_url="http://rlserve", transport=transport) as api:
        name = "team/run@3"  # ART's names: model@step
        loaded = await api.load_adapter(name=name, path=adapters["qv"][0])
        assert (loaded.name, loaded.version, loaded.rank) == (name, 0, 4)
        assert name in [a.name for a in (await api.adapters()).adapters]
        assert name in [card.id for card in (await api.models()).models]
        scored = await api.logprobs(model=name, tokens=SEQUENCES[:1])
        expected = forward_log_probs(adapters["qv"][1], SEQUENCES[0])
        assert close(scored.outputs[0].log_probs.full, expected)
        assert (await api.unload_adapter(name=name)).name == name
        with pytest.raises(NotFoundError):
            await api.unload_adapter(name=name)


async def test_a_push_of_new_tensors_is_the_next_version_without_a_pause(client, adapters):
    """A trainer's step: only the adapter's tensors (PEFT's state dict), no folder."""
    registry = client.app.state.registry
    await load(client, "pushed", adapters["qv"][0])
    trained = adapters["qv-next"][1]
    payload = save(get_peft_model_state_dict(trained))
    response = await client.put("/v1/adapters/pushed", content=payload)
    assert response.status_code == 200, response.text
    assert (response.json()["version"], response.json()["source"]) == (1, "upload")
    body = await scores(client, "pushed", SEQUENCES[:2])
    assert body["policy_version"] == 1
    for sequence, output in zip(SEQUENCES[:2], body["outputs"], strict=True):
        assert close(output["log_probs"]["full"], forward_log_probs(trained, sequence))
    assert registry.policy_version == 0  # the policy itself did not change

    # a row that started on version 1 finishes on it while version 2 arrives
    slow = client.post(
        "/v1/generate",
        json={"model": "pushed", "tokens": [PROMPT], "max_new_tokens": 500, "ignore_eos": True},
    )
    started = asyncio.ensure_future(slow)
    while registry.gate.state().in_flight_generations == 0:
        await asyncio.sleep(0.001)
    third = await client.put("/v1/adapters/pushed", content=payload)
    assert third.json()["version"] == 2
    # (the push did not pause the generation; on this backend its hooks go in between model
    # calls, so it may wait for the call in progress)
    generated = (await started).json()
    assert generated["policy_version"] == 1
    spans = generated["outputs"][0][0]["policy_versions"]
    assert spans == [{"version": 1, "start": 0, "end": 500}]

    other_layout = save(get_peft_model_state_dict(adapters["mlp"][1]))
    refused = await client.put("/v1/adapters/pushed", content=other_layout)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "body"
    unknown = await client.put("/v1/adapters/never-loaded", content=payload)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "name"
    assert registry.adapters["pushed"].version == 2


async def test_an_adapters_rollouts_penalise_its_kl_against_its_base(client, adapters, hf_model):
    """Episodes sampled by an adapter, with a KL penalty: the penalty is the adapter's KL to
    its base (the adapter off), over the action's tokens, unless the env names its model."""
    await load(client, "sampler", adapters["qv"][0])
    env = {"kind": "tokens", "dataset": "arithmetic", "max_turns": 1, "kl": {"coeff": 0.5}}
    generation = {"model": "sampler", "max_new_tokens": 5, "seed": 3}
    body = {"env": env, "num_episodes": 2, "generation": generation}
    answer = await client.post("/v1/rollouts", json=body)
    assert answer.status_code == 200, answer.text
    for trajectory in answer.json()["trajectories"]:
        (step,) = trajectory["steps"]
        full, prompt = step["tokens"]["full"], step["tokens"]["prompt"]
        policy = forward_log_probs(adapters["qv"][1], full)[len(prompt) :]
        base = forward_log_probs(hf_model, full)[len(prompt) :]
        expected = sum(p - q for p, q in zip(policy, base, strict=True))
        assert abs(expected) > 1e-3  # the adapter changes the model: the check can fail
        assert step["info"]["reward"]["kl"] == pytest.approx(expected, abs=1e-4)

    # the env may name the model whose KL counts: here the policy itself (KL 0 to itself
    # only when no reference differs: the tiny server's reference is the policy's copy)
    named = {**env, "kl": {"coeff": 0.5, "model": "policy"}}
    answer = await client.post("/v1/rollouts", json={**body, "env": named})
    kls = [t["steps"][0]["info"]["reward"]["kl"] for t in answer.json()["trajectories"]]
    assert kls == [0.0, 0.0]
    unknown = {**env, "kl": {"coeff": 0.5, "model": "no-such-adapter"}}
    refused = await client.post("/v1/rollouts", json={**body, "env": unknown})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "env.kl.model"
    session = await client.post("/v1/envs", json=unknown)
    assert session.status_code == 404 and session.json()["error"]["param"] == "kl.model"


async def test_name_at_version_names_a_resident_version(client, adapters):
    """vLLM's per-version names, as ART serves each training step's adapter (`NAME@STEP`): an
    adapter's version while it is resident (models.resident_adapter_versions: the current
    and the one before), on every route; the policy while it serves that version; a version
    not resident is a 404 naming those that are, on rlserve's routes and the OpenAI ones."""
    versions = [adapters[name] for name in ("qv", "qv-next", "mlp")]
    for version, (folder, _) in enumerate(versions):
        assert (await load(client, "steps", folder))["version"] == version
        expected = forward_log_probs(versions[version][1], SEQUENCES[0])
        body = await scores(client, f"steps@{version}", SEQUENCES[:1])
        assert close(body["outputs"][0]["log_probs"]["full"], expected)
        assert body["policy_version"] == version  # an adapter answers its own version
        if version:  # the version before is still resident, and served as it was
            before = forward_log_probs(versions[version - 1][1], SEQUENCES[0])
            body = await scores(client, f"steps@{version - 1}", SEQUENCES[:1])
            assert close(body["outputs"][0]["log_probs"]["full"], before)
    chat = await client.post(
        "/v1/completions",
        json={
            "model": "steps@1",
            "prompt": PROMPT,
            "max_tokens": 3,
            "logprobs": 0,
            "seed": 1,
            "return_token_ids": True,
        },
    )
    assert chat.status_code == 200, chat.text
    (choice,) = chat.json()["choices"]
    tokens = choice["logprobs"]["tokens"]
    scored = await scores(client, "steps@1", [PROMPT + choice["token_ids"]])
    assert close(
        choice["logprobs"]["token_logprobs"], scored["outputs"][0]["log_probs"]["full"][5:], 1e-4
    )
    assert len(tokens) == 3
    for name, route, body in (
        ("steps@0", "/v1/logprobs", {"tokens": SEQUENCES[:1]}),
        ("steps@7", "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}),
    ):
        gone = await client.post(route, json={"model": name, **body})
        assert gone.status_code == 404, gone.text
        message = gone.json()["error"]["message"]
        assert gone.json()["error"]["param"] == "model" and "resident: [1, 2]" in message
    policy = (await client.get("/v1/weights/version")).json()["policy_version"]
    body = await scores(client, f"policy@{policy}", SEQUENCES[:1])
    assert (
        body["outputs"][0]["log_probs"]["full"]
        == (await scores(client, "policy", SEQUENCES[:1]))["outputs"][0]["log_probs"]["full"]
    )
    other = await client.post(
        "/v1/completions", json={"model": f"policy@{policy + 1}", "prompt": "a", "max_tokens": 1}
    )
    assert other.status_code == 404 and f"serves version {policy}" in other.text
    unknown = await client.post(
        "/v1/completions", json={"model": "nothing@1", "prompt": "a", "max_tokens": 1}
    )
    assert unknown.status_code == 404 and "steps" in unknown.json()["error"]["message"]
    await client.delete("/v1/adapters/steps")
    gone = await client.post("/v1/logprobs", json={"model": "steps@2", "tokens": SEQUENCES})
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
