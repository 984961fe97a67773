"""Weight updates that used to poison or freeze the server: NaN tensors, a FIFO named like a
checkpoint, an upload cut short, an upload larger than the disk. Each is refused before the
swap: the served version and scores stay as they were."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from safetensors.torch import load_file, save_file

from app.config import Settings
from app.engine.loader import builtin_model_dir
from app.main import create_app
from tests.conftest import served_app

SEQUENCE = {"tokens": [[5, 6, 7, 8, 9]]}


@pytest.fixture
async def fresh(
    settings: Settings, tmp_path: Path
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with served_app(settings.replace(storage={"data_dir": tmp_path / "data"})) as client:
        yield client.app, client


async def snapshot(client: httpx.AsyncClient) -> tuple[int, list[float]]:
    version = (await client.get("/v1/weights/version")).json()["policy_version"]
    scored = (await client.post("/v1/logprobs", json=SEQUENCE)).json()
    return version, scored["outputs"][0]["log_probs"]["full"]


async def test_non_finite_tensors_are_refused_before_the_swap(fresh, settings, tmp_path):
    _, client = fresh
    before = await snapshot(client)
    state = load_file(builtin_model_dir(settings.models) / "model.safetensors")
    name = next(n for n, t in state.items() if t.is_floating_point())
    for poison in (float("nan"), float("inf")):
        state[name].view(-1)[3] = poison
        path = tmp_path / "poisoned.safetensors"
        save_file(state, str(path))
        loaded = await client.post("/v1/weights/load", json={"path": str(path)})
        assert loaded.status_code == 422, loaded.text
        assert loaded.json()["error"]["param"] == "path"
        assert name in loaded.json()["error"]["message"]
        uploaded = await client.put("/v1/weights", content=path.read_bytes())
        assert uploaded.status_code == 422 and uploaded.json()["error"]["param"] == "body"
    assert await snapshot(client) == before


async def test_a_fifo_named_like_a_checkpoint_does_not_freeze_the_server(fresh, tmp_path):
    _, client = fresh
    fifo = tmp_path / "ckpt" / "model.safetensors"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    for path in (fifo, fifo.parent):
        refused = await asyncio.wait_for(
            client.post("/v1/weights/load", json={"path": str(path)}), timeout=10
        )
        assert refused.status_code == 422 and "not a regular file" in refused.text
    assert (await client.get("/health")).status_code == 200


async def test_uploads_leave_no_file_behind(fresh, settings, tmp_path, monkeypatch):
    app, client = fresh
    uploads = tmp_path / "data" / "uploads"
    payload = (builtin_model_dir(settings.models) / "model.safetensors").read_bytes()

    async def cut_short() -> AsyncIterator[bytes]:
        yield payload[: len(payload) // 2]
        raise httpx.ReadError("client went away")

    with contextlib.suppress(httpx.ReadError):  # the app sees the body fail mid-stream
        await client.put("/v1/weights", content=cut_short())
    assert list(uploads.glob("*")) == []
    # Larger than the free disk: refused while streaming, nothing left either.
    usage = shutil.disk_usage(uploads)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda _: usage._replace(free=(64 << 20) + len(payload) // 2)
    )
    refused = await client.put("/v1/weights", content=payload)
    assert refused.status_code == 413 and "free disk" in refused.json()["error"]["message"]
    assert list(uploads.glob("*")) == []
    # A file a killed server left behind is removed at the next start.
    (uploads / "tmpabc.safetensors").write_bytes(b"partial")
    restarted = create_app(app.state.settings)
    async with restarted.router.lifespan_context(restarted):
        assert list(uploads.glob("*")) == []


async def test_a_checkpoint_rewritten_during_a_load_is_refused_whole(
    fresh, settings, tmp_path, monkeypatch
):
    """The load copies the checkpoint first; when the original changes during the copy (a
    trainer still writing it), nothing is applied, and a later load of the finished file is."""
    _, client = fresh
    before = await snapshot(client)
    state = load_file(builtin_model_dir(settings.models) / "model.safetensors")
    for tensor in state.values():
        if tensor.is_floating_point():
            tensor.mul_(0.5)
    path = tmp_path / "ckpt.safetensors"
    save_file(state, str(path))
    real_copy = shutil.copyfileobj

    def copy_while_rewritten(source, target, length=0):  # type: ignore[no-untyped-def]
        real_copy(source, target, length)
        with path.open("r+b") as again:  # the writer touches the file meanwhile
            again.seek(-4, os.SEEK_END)
            again.write(b"\0\0\0\0")

    monkeypatch.setattr(shutil, "copyfileobj", copy_while_rewritten)
    refused = await client.post("/v1/weights/load", json={"path": str(path)})
    assert refused.status_code == 409 and refused.json()["error"]["param"] == "path"
    assert await snapshot(client) == before
    assert list((tmp_path / "data" / "uploads").glob("*")) == []
    monkeypatch.setattr(shutil, "copyfileobj", real_copy)
    save_file(state, str(path))
    loaded = await client.post("/v1/weights/load", json={"path": str(path)})
    assert loaded.status_code == 200, loaded.text
    after = await snapshot(client)
    assert after[0] == before[0] + 1 and after[1] != before[1]


@pytest.mark.parametrize("version", [2**53, 2**63, 10**30])
async def test_a_version_no_trainer_can_count_is_refused_by_name(fresh, settings, version):
    """Weight versions are 1 to 2^53 - 1 (what a JSON number holds exactly): a larger one,
    on any route that names a version, is refused naming its field, and the server's count
    (and the trainer's next version) is as it was."""
    _, client = fresh
    checkpoint = str(builtin_model_dir(settings.models))
    before = await snapshot(client)
    attempts = [
        ("POST", "/v1/weights/load", {"json": {"path": checkpoint, "version": version}}),
        ("PUT", f"/v1/weights?version={version}", {"content": b"unread"}),
        (
            "POST",
            "/update_weights_from_disk",  # SGLang's, whose versions are strings
            {"json": {"model_path": checkpoint, "weight_version": str(version)}},
        ),
    ]
    for method, path, body in attempts:
        refused = await client.request(method, path, **body)
        assert refused.status_code in (400, 422), (path, refused.text)
        assert "version" in refused.text, (path, refused.text)
    assert await snapshot(client) == before
    largest = (1 << 53) - 1
    loaded = await client.post("/v1/weights/load", json={"path": checkpoint, "version": 2})
    assert loaded.status_code == 200 and loaded.json()["policy_version"] == 2
    loaded = await client.post("/v1/weights/load", json={"path": checkpoint, "version": largest})
    assert loaded.status_code == 200 and loaded.json()["policy_version"] == largest
