"""Which engines serve LoRA adapters. The transformers backend always does; a vLLM engine does
with vLLM's LoRA layers on (RLSERVE_VLLM__MAX_LORAS), and otherwise refuses adapters by name
rather than serving the policy under an adapter's name. On vLLM, what it serves for an adapter
equals PEFT's own forward of the same adapter (an independent implementation), rows of
several adapters and of the policy run side by side, and a full-weight update of the policy
keeps its adapters on the new weights (on a random model of SmolLM2's architecture)."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import (
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from rlserve_client.lora import adapter_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from app.config import Settings
from app.engine.builtin_model import HEAD_DIM
from tests.adapters.models import SEQUENCES, assert_peft, log_probs, peft_model
from tests.conftest import (
    assert_close,
    backend_settings,
    forward_log_probs,
    served_app,
    vllm_installed,
)
from tests.weights.conftest import loop_client

PROMPT = [3, 14, 15, 92, 65]
VLLM = pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")


async def test_an_engine_without_adapters_refuses_them_by_name(client, backend_name, tmp_path):
    response = await client.post("/v1/adapters", json={"name": "a", "path": str(tmp_path)})
    error = response.json()["error"]
    if backend_name == "vllm":
        assert response.status_code == 422 and error["param"] == "path"
        assert "RLSERVE_VLLM__MAX_LORAS" in error["message"]
    else:  # the transformers backend reads the folder (an empty one here)
        assert response.status_code == 404 and "adapter_config.json" in error["message"]
    models = await client.post("/v1/logprobs", json={"model": "a", "tokens": [[1, 2, 3]]})
    assert models.status_code == 404 and models.json()["error"]["param"] == "model"


ATTENTION = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]}
MLP = {
    "r": 8,
    "lora_alpha": 8,
    "target_modules": ["gate_proj", "up_proj", "down_proj"],
    "rank_pattern": {"down_proj": 4},
    "use_rslora": True,
}


def llama_dir(into: Path, tokenizer_dir: Path, seed: int) -> Path:
    """A random-weights model of SmolLM2's architecture (Llama), the built-in model's size:
    vLLM gives Llama, unlike Qwen2, LoRA on the output head, whose scoring path
    `app.engine.vllm.worker.fix_lora_ops` fixes."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=4 * HEAD_DIM,
        intermediate_size=16 * HEAD_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        initializer_range=0.2,  # peaked distributions, as the built-in model's
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).eval().save_pretrained(into)
    tokenizer.save_pretrained(into)
    return into


@pytest.fixture(scope="module")
def llama(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two Llama models of the same shapes (the second for a full-weight update)."""
    root = tmp_path_factory.mktemp("llama")
    return llama_dir(root / "a", model_dir, 0), llama_dir(root / "b", model_dir, 1)


@pytest.fixture(scope="module")
async def lora_client(
    settings: Settings, llama: tuple[Path, Path]
) -> AsyncIterator[httpx.AsyncClient]:
    configured = backend_settings(settings, "vllm").replace(
        vllm={"max_loras": 2, "max_lora_rank": 8},
        models={"model": str(llama[0]), "load_reference": False},
        storage={"data_dir": settings.storage.data_dir / "vllm-lora"},
    )
    async with served_app(configured, timeout=300) as c:
        yield c


@VLLM
@pytest.mark.vllm
async def test_vllm_serves_adapters_as_peft_computes_them(lora_client, llama):
    client = lora_client
    model_dir, other_dir = llama
    attention, mlp = peft_model(model_dir, 1, **ATTENTION), peft_model(model_dir, 2, **MLP)
    for name, model in (("attention", attention), ("mlp", mlp)):
        pushed = await client.put(f"/v1/adapters/{name}", content=adapter_file(model))
        assert pushed.status_code == 200, pushed.text
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # rows of two adapters and of the policy, all at once
    served = await asyncio.gather(*(log_probs(client, m) for m in ("attention", "mlp", "policy")))
    assert_peft(served[0], attention)
    assert_peft(served[1], mlp)
    assert_peft(served[2], base)

    # more prompt tokens at once than one engine step takes (vLLM splits their prefill):
    # each row still gets its own adapter, or none
    rng = random.Random(0)
    long = [[rng.randrange(3, 250) for _ in range(rng.randrange(8, 300))] for _ in range(24)]
    names = ["attention", "mlp", "policy"]
    answers = await asyncio.gather(
        *(
            client.post(
                "/v1/logprobs", json={"model": names[k % 3], "tokens": long[4 * k : 4 * k + 4]}
            )
            for k in range(6)
        )
    )
    references = {"attention": attention, "mlp": mlp, "policy": base}
    for k, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        for sequence, output in zip(long[4 * k : 4 * k + 4], answer.json()["outputs"], strict=True):
            expected = forward_log_probs(references[names[k % 3]], sequence)
            assert_close(output["log_probs"]["full"], expected, 1e-4)

    # greedy generation with an adapter: PEFT's own greedy continuation
    body = {"model": "attention", "tokens": [PROMPT], "max_new_tokens": 6}
    body |= {"temperature": 0, "ignore_eos": True}
    answer = (await client.post("/v1/generate", json=body)).json()["outputs"][0][0]
    with torch.inference_mode():
        expected = attention.generate(
            torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, min_new_tokens=6
        )[0, len(PROMPT) :].tolist()
    assert answer["tokens"]["response"] == expected

    # KL against the base with the adapter off, though no reference model is loaded
    kl = await client.post(
        "/v1/kl", json={"model": "attention", "tokens": SEQUENCES, "assistant_only": False}
    )
    assert kl.status_code == 200, kl.text
    for sequence, output in zip(SEQUENCES, kl.json()["outputs"], strict=True):
        p, q = forward_log_probs(attention, sequence), forward_log_probs(base, sequence)
        assert_close(output["kl"][1:], [a - b for a, b in zip(p, q, strict=True)][1:], 2e-4)

    # a push of new tensors is the next version; the version before stays resident
    # (attention@0: models.resident_adapter_versions), the one before that goes with its last
    # holder (its folder removed, its LoRA id dropped from the engine at the next load)
    backend = client.app.state.registry.get("policy").backend  # type: ignore[attr-defined]
    folders = sorted(backend.loras.folder.iterdir())
    assert len(folders) == 2
    trained = peft_model(model_dir, 3, **ATTENTION)
    pushed = await client.put("/v1/adapters/attention", content=adapter_file(trained))
    assert pushed.json()["version"] == 1
    assert_peft(await log_probs(client, "attention"), trained)
    assert_peft(await log_probs(client, "attention@0"), attention)
    gc.collect()
    assert folders[0] in list(backend.loras.folder.iterdir())
    again = peft_model(model_dir, 5, **ATTENTION)
    pushed = await client.put("/v1/adapters/attention", content=adapter_file(again))
    assert pushed.json()["version"] == 2
    assert_peft(await log_probs(client, "attention@1"), trained)
    gc.collect()
    assert folders[0] not in list(backend.loras.folder.iterdir())

    # too large a rank is refused naming the setting
    big = {**ATTENTION, "r": 16}
    refused = await client.put(
        "/v1/adapters/big", content=adapter_file(peft_model(model_dir, 4, **big))
    )
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "body"
    assert "RLSERVE_VLLM__MAX_LORA_RANK" in refused.json()["error"]["message"]

    # a full-weight update of the policy: the adapters now adapt the new weights
    loaded = await client.post("/v1/weights/load", json={"path": str(other_dir)})
    assert loaded.status_code == 200, loaded.text
    other = peft_model(other_dir, 2, **MLP)
    set_peft_model_state_dict(other, get_peft_model_state_dict(mlp))  # same adapter, new base
    assert_peft(await log_probs(client, "mlp"), other)
    new_base = AutoModelForCausalLM.from_pretrained(other_dir, dtype=torch.float32).eval()
    assert_peft(await log_probs(client, "policy"), new_base)


@VLLM
@pytest.mark.vllm
async def test_vllm_serves_an_adapter_pushed_over_the_transfer(lora_client, llama):
    """Over gloo, into the workers' staging: an adapter of q_proj and v_proj but not k_proj
    (which vLLM fuses with them in the model, and an update of the model must send
    together) is served as PEFT computes it, and the policy stays as it was."""
    client = lora_client
    model_dir = llama[0]
    loaded = await client.post("/v1/weights/load", json={"path": str(model_dir)})
    assert loaded.status_code == 200, loaded.text
    await client.delete("/v1/adapters/mlp")  # (room in the engine's LoRA slots, if served)
    policy = await log_probs(client, "policy")
    adapter = peft_model(model_dir, 5, **ATTENTION)
    api = loop_client(client.app, asyncio.get_running_loop())  # type: ignore[attr-defined]

    def push() -> Any:
        with api.weight_transfer(timeout_s=120) as sync:
            return sync.send_adapter(adapter, "over-gloo")

    pushed = await asyncio.to_thread(push)
    assert (pushed.adapter, pushed.adapter_version) == ("over-gloo", 0)
    assert_peft(await log_probs(client, "over-gloo"), adapter)
    assert await log_probs(client, "policy") == policy
