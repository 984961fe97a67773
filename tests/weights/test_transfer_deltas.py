"""Deltas over the collective transfer (gloo on this CPU): with `weight_transfer(deltas=True)`
the trainer's client sends its first push whole and each later one as a delta of the last the
server took, as one uint8 tensor over the group; the server stages it against its weights and
checks it before the commit. A chain of deltas serves exactly the trainer's weights; a delta
the server finds on another base is refused (409) and the client sends that push whole."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from rlserve_client.weight_delta import weights_digest
from safetensors.torch import save

from app.config import Settings
from tests.conftest import assert_close, forward_log_probs, served_app
from tests.weights.conftest import loop_client

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [100, 101, 102, 7]]


@pytest.fixture
async def server(settings: Settings, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        models={"load_reference": False}, storage={"data_dir": tmp_path / "data"}
    )
    async with served_app(config) as client:
        yield client


def step(model: torch.nn.Module, seed: int) -> None:
    """A sparse step: 2% of the elements of two tensors move."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("model.layers.0.mlp.up_proj.weight", "model.norm.weight"):
            flat = model.get_parameter(name).view(-1)
            picked = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 50)]
            flat[picked] += 0.125


async def assert_serves(http: httpx.AsyncClient, model: torch.nn.Module) -> None:
    answer = await http.post("/v1/logprobs", json={"tokens": SEQUENCES})
    assert answer.status_code == 200, answer.text
    for ids, output in zip(SEQUENCES, answer.json()["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(model, ids), 1e-5)


async def test_a_chain_of_deltas_over_the_transfer_serves_the_trainers_weights(
    server: httpx.AsyncClient, hf_model: torch.nn.Module
) -> None:
    trainer = copy.deepcopy(hf_model)
    app, loop = server.app, asyncio.get_running_loop()  # type: ignore[attr-defined]
    sync_client = loop_client(app, loop)
    sync = sync_client.weight_transfer(master_address="127.0.0.1", deltas=True)
    await asyncio.to_thread(sync.open)
    try:
        sent, digests = [], []
        for seed in range(4):  # the first whole, three deltas
            step(trainer, seed)
            sent.append(await asyncio.to_thread(sync.send, trainer))
            digests.append(weights_digest(trainer.state_dict()))
            await assert_serves(server, trainer)
        assert [s.policy_version for s in sent] == [1, 2, 3, 4]
        assert [s.digest for s in sent] == digests
        assert sent[0].sent_bytes is None  # (whole)
        for delta in sent[1:]:
            assert delta.sent_bytes is not None and delta.sent_bytes < delta.num_bytes / 3

        # Another trainer's upload: the next delta is on another base, refused (409) whole,
        # and the client sends that push whole.
        other = copy.deepcopy(trainer)
        step(other, 10)
        upload = await server.put("/v1/weights", content=save(dict(other.state_dict())))
        assert upload.status_code == 200, upload.text
        step(trainer, 11)
        again = await asyncio.to_thread(sync.send, trainer)
        assert again.policy_version == 6 and again.sent_bytes is None
        await assert_serves(server, trainer)
        assert (await server.get("/ready")).json()["digests"]["policy"] == weights_digest(
            trainer.state_dict()
        )
        step(trainer, 12)
        after = await asyncio.to_thread(sync.send, trainer)
        assert after.sent_bytes is not None and after.policy_version == 7
        await assert_serves(server, trainer)
    finally:
        await asyncio.to_thread(sync.close)
        sync_client.close()


async def test_a_corrupt_delta_over_the_transfer_changes_nothing(
    server: httpx.AsyncClient, hf_model: torch.nn.Module
) -> None:
    """Bytes that are not a delta: refused at finish naming the tensor announced; the
    served weights and version stay, and the group takes the next update."""
    from rlserve_client import BadRequestError, UnprocessableEntityError
    from rlserve_client.weight_delta import TRANSFER_NAME

    app, loop = server.app, asyncio.get_running_loop()  # type: ignore[attr-defined]
    sync_client = loop_client(app, loop)
    sync = sync_client.weight_transfer(master_address="127.0.0.1")
    await asyncio.to_thread(sync.open)
    try:
        junk = [(TRANSFER_NAME, torch.arange(64, dtype=torch.uint8))]
        with pytest.raises((BadRequestError, UnprocessableEntityError)) as refused:
            await asyncio.to_thread(sync._send, junk, {}, delta=True)
        assert refused.value.param == "names"
        await assert_serves(server, hf_model)
        assert (await server.get("/v1/weights/version")).json()["policy_version"] == 0
        trainer = copy.deepcopy(hf_model)
        step(trainer, 1)
        assert (await asyncio.to_thread(sync.send, trainer)).policy_version == 1
        await assert_serves(server, trainer)
    finally:
        await asyncio.to_thread(sync.close)
        sync_client.close()
