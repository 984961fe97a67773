"""Published snapshots: a whole checkpoint from a path, then deltas chained to it from an HTTP
URL; a bad one (wrong base, corrupt, another digest, nothing at the URL) leaves the current
snapshot served and says why."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from rlserve_client.weight_delta import DeltaEncoder, weights_digest
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from tests.conftest import assert_close, forward_log_probs
from tests.weights.test_deltas import corrupt_a_frame, optimizer_step, served_state

SEQUENCE = [7, 8, 9, 10, 11, 12]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """An object store: files under a folder, served over HTTP on a free port."""
    folder = tmp_path / "bucket"
    folder.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield folder, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


async def served(client: httpx.AsyncClient) -> dict:
    body = (await client.get("/v1/weights/snapshots")).json()
    assert body["model"] == "policy" and len(body["replicas"]) == 1
    return body["replicas"][0]


async def test_a_whole_snapshot_then_deltas_from_a_url(own_server, store, model_dir, tmp_path):
    _app, client = own_server
    bucket, url = store
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer_step(trainer, seed=1)
    whole = tmp_path / "step-1.safetensors"
    save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, str(whole))
    digest = weights_digest(trainer.state_dict())
    first = await client.post(
        "/v1/weights/snapshots",
        json={"identity": "run-a/1", "source": str(whole), "digest": digest},
    )
    assert first.status_code == 200, first.text
    assert first.json()["snapshot"] == "run-a/1" and first.json()["digest"] == digest
    encoder = DeltaEncoder()
    encoder.remember(trainer.state_dict(), first.json()["policy_version"], digest)
    for step in (2, 3):
        optimizer_step(trainer, seed=step)
        (bucket / f"step-{step}.delta").write_bytes(encoder.encode(trainer.state_dict()).blob)
        body = {
            "identity": f"run-a/{step}",
            "base": f"run-a/{step - 1}",
            "source": f"{url}/step-{step}.delta?X-Signature=secret",
            "digest": weights_digest(trainer.state_dict()),
        }
        loaded = await client.post("/v1/weights/snapshots", json=body)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["sent_bytes"] < loaded.json()["num_bytes"]
        encoder.remember(trainer.state_dict(), loaded.json()["policy_version"], body["digest"])
    state = await served(client)
    assert state == {
        "replica": None,
        "version": 3,
        "digest": weights_digest(trainer.state_dict()),
        "snapshot": "run-a/3",
        "stage": "serving",
        "last_error": None,
    }
    scored = await client.post("/v1/logprobs", json={"tokens": [SEQUENCE]})
    got = scored.json()["outputs"][0]["log_probs"]["full"]
    assert_close(got, forward_log_probs(trainer, SEQUENCE), 1e-5)


@pytest.mark.parametrize("fault", ["wrong base", "no base", "corrupt", "other digest", "404"])
async def test_a_bad_snapshot_leaves_the_current_one_served(
    own_server, store, model_dir, tmp_path, fault
):
    app, client = own_server
    bucket, url = store
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    whole = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in trainer.state_dict().items()}, str(whole))
    assert (
        await client.post("/v1/weights/snapshots", json={"identity": "s0", "source": str(whole)})
    ).status_code == 200
    before = {k: v.clone() for k, v in served_state(app).items()}
    state = await served(client)
    encoder = DeltaEncoder()
    encoder.remember(trainer.state_dict(), 1, state["digest"])
    optimizer_step(trainer, seed=5)
    blob = encoder.encode(trainer.state_dict()).blob
    body = {"identity": "s1", "base": "s0", "source": f"{url}/s1.delta?sig=secret"}
    param, status = "base", 409
    if fault == "wrong base":
        body["base"] = "s-other"
    elif fault == "no base":
        del body["base"]
        status = 422
    elif fault == "corrupt":
        blob, param, status = corrupt_a_frame(blob), "source", (400, 409)
    elif fault == "other digest":
        body["digest"], param = "xxh3-128:" + "0" * 32, "digest"
    else:
        body["source"], param, status = f"{url}/missing.delta?sig=secret", "source", 404
    (bucket / "s1.delta").write_bytes(blob)
    refused = await client.post("/v1/weights/snapshots", json=body)
    assert refused.status_code in (status if isinstance(status, tuple) else (status,)), refused.text
    error = refused.json()["error"]
    assert error["param"] == param and "secret" not in error["message"]
    after = await served(client)
    assert (after["snapshot"], after["version"], after["digest"]) == ("s0", 1, state["digest"])
    assert after["last_error"] == error["message"]
    for name, tensor in served_state(app).items():
        assert torch.equal(tensor, before[name]), name
