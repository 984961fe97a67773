"""Weight updates: new weights score like an independent forward of them; refusals change
nothing; requests during an update are consistent with the version they report."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.engine.builtin_model import build_model
from app.engine.loader import builtin_model_dir
from tests.conftest import (
    assert_close,
    backend_settings,
    forward_log_probs,
    served_app,
    vllm_installed,
)

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [100, 101, 102]]


@pytest.fixture
async def fresh(settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A server of its own: these tests change its weights."""
    async with served_app(settings) as client:
        yield client.app, client


@pytest.fixture(scope="module")
def other_dir(settings: Settings) -> Path:
    return builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)


@pytest.fixture(scope="module")
def other_model(other_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(other_dir).eval()


async def score(client: httpx.AsyncClient, model: str = "policy") -> tuple[int, list[list[float]]]:
    body = (await client.post("/v1/logprobs", json={"tokens": SEQUENCES, "model": model})).json()
    return body["policy_version"], [o["log_probs"]["full"] for o in body["outputs"]]


async def test_upload_replaces_the_policy_only(fresh, other_dir, other_model, hf_model):
    _app, client = fresh
    payload = (other_dir / "model.safetensors").read_bytes()
    response = await client.put("/v1/weights", content=payload)
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == 1
    assert (await client.get("/v1/weights/version")).json() == {
        "policy_version": 1,
        "reference_version": 0,
    }
    version, values = await score(client)
    assert version == 1
    for seq, got in zip(SEQUENCES, values, strict=True):
        assert_close(got, forward_log_probs(other_model, seq), 1e-5)
    _, reference = await score(client, "reference")
    for seq, got in zip(SEQUENCES, reference, strict=True):
        assert_close(got, forward_log_probs(hf_model, seq), 1e-5)
    kl = (await client.post("/v1/kl", json={"tokens": SEQUENCES, "assistant_only": False})).json()
    assert kl["policy_version"] == 1 and any(o["kl_sum"] != 0 for o in kl["outputs"])


async def test_load_from_path(fresh, other_dir, other_model):
    _, client = fresh
    response = await client.post("/v1/weights/load", json={"path": str(other_dir)})
    assert response.status_code == 200, response.text
    assert response.json()["num_tensors"] == len(load_file(other_dir / "model.safetensors"))
    version, values = await score(client)
    assert version == 1
    assert_close(values[0], forward_log_probs(other_model, SEQUENCES[0]), 1e-5)


async def test_partial_update_changes_only_those_parameters(fresh, other_dir, tmp_path):
    app, client = fresh
    name = "model.layers.0.mlp.up_proj.weight"
    new = load_file(other_dir / "model.safetensors")[name]
    save_file({name: new}, tmp_path / "part.safetensors")
    model = app.state.registry.get("policy").backend.model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    response = await client.put("/v1/weights", content=(tmp_path / "part.safetensors").read_bytes())
    assert response.status_code == 200 and response.json()["num_tensors"] == 1
    after = model.state_dict()
    for key, value in after.items():
        if key == name:
            assert torch.equal(value, new)
        else:
            assert torch.equal(value, before[key]), key


def _payloads(other_dir: Path, tmp_path: Path) -> dict[str, tuple[bytes, int, str]]:
    state = load_file(other_dir / "model.safetensors")
    name = "model.norm.weight"
    cases = {
        "unknown name": ({"model.layers.99.bogus": state[name]}, 422, "unknown parameter"),
        "wrong shape": ({name: torch.ones(3)}, 422, "has shape [3]"),
        "wrong dtype": ({name: state[name].half()}, 422, "has dtype F16"),
    }
    out = {}
    for label, (tensors, status, words) in cases.items():
        path = tmp_path / f"{label}.safetensors"
        save_file(tensors, path)
        out[label] = (path.read_bytes(), status, words)
    full = (other_dir / "model.safetensors").read_bytes()
    out["truncated"] = (full[: len(full) // 2], 400, "not a valid safetensors file")
    out["corrupt"] = (b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", 400, "not a valid")
    out["empty"] = (b"", 400, "empty")
    return out


async def test_refused_updates_change_nothing(fresh, other_dir, tmp_path):
    _, client = fresh
    version, before = await score(client)
    for label, (payload, status, words) in _payloads(other_dir, tmp_path).items():
        response = await client.put("/v1/weights", content=payload)
        assert response.status_code == status, (label, response.text)
        assert words in response.json()["error"]["message"], label
        assert await score(client) == (version, before), label  # bit-identical
    for path in (tmp_path / "missing", tmp_path / "empty-dir"):
        (tmp_path / "empty-dir").mkdir(exist_ok=True)
        response = await client.post("/v1/weights/load", json={"path": str(path)})
        assert response.status_code == 404 and response.json()["error"]["param"] == "path"
    assert await score(client) == (version, before)
    assert (await client.get("/v1/weights/version")).json()["policy_version"] == 0


async def test_requests_during_an_update_match_the_version_they_report(
    fresh, other_dir, other_model, hf_model
):
    _, client = fresh
    expected = {
        0: [forward_log_probs(hf_model, s) for s in SEQUENCES],
        1: [forward_log_probs(other_model, s) for s in SEQUENCES],
    }
    payload = (other_dir / "model.safetensors").read_bytes()

    async def stream() -> list[tuple[int, list[list[float]]]]:
        return [await score(client) for _ in range(12)]

    streams = [asyncio.create_task(stream()) for _ in range(4)]
    await asyncio.sleep(0.02)
    update = await client.put("/v1/weights", content=payload)
    assert update.status_code == 200
    results = [r for s in streams for r in await s]
    assert {v for v, _ in results} <= {0, 1}
    for version, values in results:
        for got, want in zip(values, expected[version], strict=True):
            assert_close(got, want, 1e-5)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_vllm_upload_then_score_equals_the_new_weights(settings, other_dir, other_model):
    vllm_settings = backend_settings(settings, "vllm").replace(models={"load_reference": False})
    async with served_app(vllm_settings) as client:
        payload = (other_dir / "model.safetensors").read_bytes()
        response = await client.put("/v1/weights", content=payload)
        assert response.status_code == 200, response.text
        version, values = await score(client)
        bad = await client.put("/v1/weights", content=payload[:100])
        assert bad.status_code == 400
        assert await score(client) == (version, values)
    assert version == 1
    for seq, got in zip(SEQUENCES, values, strict=True):
        assert_close(got, forward_log_probs(other_model, seq), 1e-3)


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_vllm_refuses_updates_of_tied_embedding_models(settings, tmp_path):
    tied = build_model(tmp_path / "tied", seed=2, tie_embeddings=True)
    vllm_settings = backend_settings(settings, "vllm").replace(
        models={"model": str(tied), "load_reference": False}
    )
    async with served_app(vllm_settings) as client:
        before = await score(client)
        payload = (tied / "model.safetensors").read_bytes()
        response = await client.put("/v1/weights", content=payload)
        assert response.status_code == 422
        assert "tied input/output embeddings" in response.json()["error"]["message"]
        assert await score(client) == before


async def _restore_round_trip(client: httpx.AsyncClient, other_dir: Path) -> None:
    """Upload other weights, restore: the starting scores come back, as version 2."""
    started_with = await score(client)
    payload = (other_dir / "model.safetensors").read_bytes()
    assert (await client.put("/v1/weights", content=payload)).status_code == 200
    assert (await score(client))[1] != started_with[1]
    response = await client.post("/v1/weights/restore", json={})
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "policy" and response.json()["policy_version"] == 2
    assert response.json()["num_tensors"] == len(load_file(other_dir / "model.safetensors"))
    assert await score(client) == (2, started_with[1])


async def test_restore_serves_the_starting_weights_again(fresh, other_dir, hf_model):
    _, client = fresh
    await _restore_round_trip(client, other_dir)
    # The reference is restored only when named, as updates reach it only when named.
    before = await score(client, "reference")
    response = await client.post("/v1/weights/restore", json={"model": "reference"})
    assert response.status_code == 200, response.text
    assert response.json()["reference_version"] == 1
    assert (await score(client, "reference"))[1] == before[1]
    for seq, got in zip(SEQUENCES, before[1], strict=True):
        assert_close(got, forward_log_probs(hf_model, seq), 1e-5)


async def test_restore_refuses_a_source_changed_since_the_start(settings, tmp_path, other_dir):
    """A checkpoint saved over the served folder changes nothing served (the weights are the
    server's own, not views of the files), and restoring from it is refused."""
    source = build_model(tmp_path / "policy", seed=3)
    config = settings.replace(models={"model": str(source), "load_reference": False})
    async with served_app(config) as client:
        before = await score(client)
        # The trainer saved its checkpoint over the folder the server started from.
        (source / "model.safetensors").write_bytes((other_dir / "model.safetensors").read_bytes())
        response = await client.post("/v1/weights/restore", json={"model": "policy"})
        assert response.status_code == 409, response.text
        error = response.json()["error"]
        assert error["param"] == "model"
        assert "model.safetensors" in error["message"]
        assert "no longer holds the weights the server started with" in error["message"]
        assert await score(client) == before
        unknown = await client.post("/v1/weights/restore", json={"model": "critic"})
        assert unknown.status_code == 422
        assert unknown.json()["error"]["param"] == "model"


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_vllm_restore_serves_the_starting_weights_again(settings, other_dir):
    vllm_settings = backend_settings(settings, "vllm").replace(models={"load_reference": False})
    async with served_app(vllm_settings) as client:
        await _restore_round_trip(client, other_dir)
