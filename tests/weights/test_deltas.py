"""Weight deltas over HTTP and from a path: a chain rebuilds the trainer's weights bit for bit;
a corrupt byte, a wrong base or a missing link is refused whole, the served weights and their
digest untouched."""

from __future__ import annotations

import asyncio
import json
import struct

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from rlserve_client.weight_delta import DeltaEncoder, raw_bytes, weights_digest
from rlserve_client.weight_push import WeightPusher
from transformers import AutoModelForCausalLM

from app.main import create_app
from tests.conftest import assert_close, forward_log_probs, started
from tests.weights.conftest import loop_client

SEQUENCE = [5, 6, 7, 8, 9, 10, 11, 12]


def served_state(app: FastAPI) -> dict[str, torch.Tensor]:
    return app.state.registry.models["policy"].backend.model.state_dict()


def optimizer_step(model: torch.nn.Module, seed: int, share: float = 0.05) -> None:
    """A sparse change as an optimizer step makes: `share` of each tensor's elements move."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            mask = torch.rand(parameter.shape, generator=generator) < share
            step = torch.randn(parameter.shape, generator=generator) * 1e-2
            parameter.add_(step * mask)


async def ready(client: httpx.AsyncClient) -> dict:
    return (await client.get("/ready")).json()


@pytest.mark.parametrize("encoding", ["auto", "xor", "overwrite"])
async def test_a_chain_of_five_deltas_rebuilds_the_weights_bitwise(own_server, model_dir, encoding):
    app, client = own_server
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = await ready(client)
    # The server's starting digest is the trainer's own weights' (independently computed).
    assert start["digests"]["policy"] == weights_digest(trainer.state_dict())
    client_ = loop_client(app, asyncio.get_running_loop())
    pusher = WeightPusher(client_, dtype=torch.float32, encoding=encoding)
    first = await asyncio.to_thread(pusher.push, trainer.state_dict())
    assert not first.delta and first.digest_ok
    for step in range(5):
        optimizer_step(trainer, seed=step)
        pushed = await asyncio.to_thread(pusher.push, trainer.state_dict())
        assert pushed.delta and pushed.digest_ok, pushed
        assert pushed.updated.policy_version == first.updated.policy_version + step + 1
        assert pushed.sent_bytes < pushed.full_bytes / (3 if encoding != "overwrite" else 1.5)
        assert 0 < pushed.changed_share < 0.2
    served = served_state(app)
    for name, tensor in trainer.state_dict().items():
        assert torch.equal(served[name], tensor), name
    assert (await ready(client))["digests"]["policy"] == weights_digest(trainer.state_dict())
    body = await client.post("/v1/logprobs", json={"tokens": [SEQUENCE]})
    got = body.json()["outputs"][0]["log_probs"]["full"]
    assert_close(got, forward_log_probs(trainer, SEQUENCE), 1e-5)


def delta_of(app: FastAPI, trainer: torch.nn.Module, version: int, digest: str | None) -> bytes:
    encoder = DeltaEncoder()
    encoder.remember(served_state(app), version, digest)
    return encoder.encode(trainer.state_dict()).blob


def corrupt_a_frame(blob: bytes) -> bytes:
    """One byte of the first tensor's compressed change flipped (past the frame's header)."""
    size = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8 : 8 + size])
    first = next(v for k, v in header.items() if k != "__metadata__")
    at = (
        8
        + size
        + first["data_offsets"][0]
        + (first["data_offsets"][1] - first["data_offsets"][0]) // 2
    )
    return blob[:at] + bytes([blob[at] ^ 0x10]) + blob[at + 1 :]


@pytest.mark.parametrize("fault", ["corrupt byte", "wrong base", "missing link", "wrong digest"])
async def test_a_bad_delta_is_refused_whole(own_server, model_dir, fault):
    app, client = own_server
    before = {k: v.clone() for k, v in served_state(app).items()}
    start = await ready(client)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer_step(trainer, seed=11)
    digest = start["digests"]["policy"]
    if fault == "corrupt byte":
        blob = corrupt_a_frame(delta_of(app, trainer, 0, digest))
    elif fault == "wrong base":
        blob = delta_of(app, trainer, 3, None)
    elif fault == "wrong digest":
        blob = delta_of(app, trainer, 0, "xxh3-128:" + "0" * 32)
    else:  # the delta of version 1 to 2 sent while version 0 is served
        step_one = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        optimizer_step(step_one, seed=12)
        encoder = DeltaEncoder()
        encoder.remember(step_one.state_dict(), 1, None)
        blob = encoder.encode(trainer.state_dict()).blob
    response = await client.put("/v1/weights", content=blob)
    assert response.status_code in (400, 409), response.text
    assert response.json()["error"]["param"] == "body"
    after = await ready(client)
    assert after["policy_version"] == 0 and after["digests"] == start["digests"]
    for name, tensor in served_state(app).items():
        assert torch.equal(tensor, before[name]), name


async def test_a_delta_folder_loads_from_a_path(own_server, model_dir, tmp_path):
    """A version folder in slime's layout (index metadata naming the encoding), loaded as any
    checkpoint is."""
    from rlserve_client import weight_delta as codec
    from safetensors.numpy import save_file

    app, client = own_server
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    optimizer_step(trainer, seed=21)
    new = {k: raw_bytes(v) for k, v in trainer.state_dict().items()}
    old = {k: raw_bytes(v).copy() for k, v in served_state(app).items()}
    folder = tmp_path / "weight_v000001"
    folder.mkdir()
    frames, sums = {}, {}
    for name in new:
        change = codec.encode(new[name], old[name], "xor")
        if change is not None:
            frames[name] = np.frombuffer(change.frame, dtype=np.uint8)
            sums[name] = codec.checksum(new[name], "adler32")
    save_file(frames, str(folder / "model-00000-of-00001.safetensors"), metadata=sums)
    index = {
        "metadata": {
            "version": "000001",
            "base_version": "000000",
            "delta_encoding": "xor",
            "compression_format": "zstd",
            "checksum_format": "adler32",
        },
        "weight_map": {name: "model-00000-of-00001.safetensors" for name in frames},
    }
    (folder / codec.INDEX).write_text(json.dumps(index))
    response = await client.post("/v1/weights/load", json={"path": str(folder)})
    assert response.status_code == 200, response.text
    assert response.json()["policy_version"] == 1
    assert response.json()["digest"] == weights_digest(trainer.state_dict())
    for name, tensor in trainer.state_dict().items():
        assert torch.equal(served_state(app)[name], tensor), name


async def test_tied_embeddings_travel_once_and_the_digest_covers_both_names(settings, tmp_path):
    """A model whose output layer is its embedding (SmolLM2's): the pusher sends the tensor
    once, the server writes it under both names, and the digest stays the trainer's."""
    from app.engine.builtin_model import build_model

    folder = tmp_path / "tied"
    build_model(folder, hidden_size=64, num_layers=2, seed=3, tie_embeddings=True)
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    state = trainer.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    config = settings.replace(
        models={"model": str(folder)}, storage={"data_dir": tmp_path / "data"}
    )
    app = create_app(config)
    async with app.router.lifespan_context(app):
        await started(app)
        pusher = WeightPusher(loop_client(app, asyncio.get_running_loop()))
        first = await asyncio.to_thread(pusher.push, trainer.state_dict())
        assert first.digest_ok and "lm_head.weight" not in pusher.encoder.base
        for step in range(2):
            optimizer_step(trainer, seed=30 + step, share=0.2)
            pushed = await asyncio.to_thread(pusher.push, trainer.state_dict())
            assert pushed.delta and pushed.digest_ok
        served = served_state(app)
        for name, tensor in trainer.state_dict().items():
            assert torch.equal(served[name], tensor), name


@pytest.mark.parametrize("encoding", ["xor", "overwrite"])
async def test_a_delta_that_makes_a_nan_is_refused(own_server, model_dir, encoding):
    app, client = own_server
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer.model.norm.weight[3] = float("nan")
    encoder = DeltaEncoder(encoding=encoding)
    encoder.remember(served_state(app), 0, None)
    response = await client.put("/v1/weights", content=encoder.encode(trainer.state_dict()).blob)
    assert response.status_code == 422, response.text
    assert "NaN or infinite" in response.json()["error"]["message"]
    assert (await ready(client))["policy_version"] == 0


async def test_every_engine_takes_deltas_and_shows_the_digest_of_what_it_serves(
    served, backend_name, model_dir
):
    """The transformers engine shows its live tensors; vLLM's runs the model in its own
    processes, and the server reads the served values from the files that hold them (the
    checkpoint, then each file update's, a delta being one). On both, the digest is the
    trainer's own weights' (independently computed), a chain of deltas serves the trainer's
    weights, and a corrupt delta changes nothing."""
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start = (await served.http.get("/ready")).json()
    assert set(start["digests"]) == {"policy", "reference"}
    assert start["digests"]["policy"] == weights_digest(trainer.state_dict())
    pusher = WeightPusher(served.trainer_client(), dtype=torch.float32)
    first = await asyncio.to_thread(pusher.push, trainer.state_dict())
    assert first.digest_ok
    tolerance = 1e-5 if backend_name == "transformers" else 1e-3
    for step in range(2):
        optimizer_step(trainer, seed=40 + step)
        pushed = await asyncio.to_thread(pusher.push, trainer.state_dict())
        assert pushed.delta and pushed.digest_ok, pushed
        assert pushed.sent_bytes < pushed.full_bytes / 3
        (got,) = await served.scores([SEQUENCE])
        assert_close(got, forward_log_probs(trainer, SEQUENCE), tolerance)
    now = (await served.http.get("/ready")).json()
    assert now["digests"]["policy"] == weights_digest(trainer.state_dict())
    encoder = DeltaEncoder()
    served_now = {k: v.clone() for k, v in trainer.state_dict().items()}
    encoder.remember(served_now, now["policy_version"], now["digests"]["policy"])
    optimizer_step(trainer, seed=49)
    blob = corrupt_a_frame(encoder.encode(trainer.state_dict()).blob)
    refused = await served.http.put("/v1/weights", content=blob)
    assert refused.status_code in (400, 409), refused.text
    assert refused.json()["error"]["param"] == "body"
    after = (await served.http.get("/ready")).json()
    assert after["policy_version"] == now["policy_version"] and after["digests"] == now["digests"]
