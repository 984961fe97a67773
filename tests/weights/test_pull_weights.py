"""slime's disk delta mode against a real server: versions published as slime's writer lays
them out (`weight_v{N:06d}` folders, zstd-compressed per-tensor changes, each tensor's checksum
in its file's metadata, the index metadata naming version, base, encoding and checksum), pulled
with `POST /pull_weights` into a local checkpoint and loaded with `/update_weights_from_disk`,
as slime's `UpdateWeightFromDiskDelta._reload_engines` calls them; served log-probs equal the
trainer's forward at every version. A corrupt version is refused and leaves the local
checkpoint as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from rlserve_client import weight_delta as codec
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from tests.conftest import assert_close, forward_log_probs
from tests.weights.test_deltas import optimizer_step

SEQUENCE = [3, 9, 27, 81, 243, 17, 5]


def publish(source: Path, version: int, new: dict, old: dict, encoding: str, checksum: str) -> Path:
    """One version folder as slime's `_write_delta_files` writes it (one rank's file)."""
    folder = source / f"weight_v{version:06d}"
    folder.mkdir(parents=True)
    frames, sums = {}, {}
    for name in new:
        change = codec.encode(new[name], old[name], encoding)
        if change is not None:
            frames[name] = np.frombuffer(change.frame, dtype=np.uint8)
            sums[name] = codec.checksum(new[name], checksum)
    file = "model-00000-of-00001.safetensors"
    save_file(frames, str(folder / file), metadata=sums)
    index = {
        "metadata": {
            "version": f"{version:06d}",
            "base_version": f"{version - 1:06d}",
            "delta_encoding": encoding,
            "compression_format": "zstd",
            "checksum_format": checksum,
        },
        "weight_map": {name: file for name in frames},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def state_bytes(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: codec.raw_bytes(t).copy() for name, t in model.state_dict().items()}


async def pull(
    client: httpx.AsyncClient, local: Path, source: Path, version: int
) -> httpx.Response:
    body = {
        "local_checkpoint_dir": str(local),
        "source_dir": str(source),
        "target_version": version,
    }
    return await client.post("/pull_weights", json=body)


async def test_three_published_versions_pulled_and_served(own_server, model_dir, tmp_path):
    _app, client = own_server
    source, local = tmp_path / "published", tmp_path / "local"
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # slime's seed call: version 0 is the engine's own checkpoint.
    assert (await pull(client, local, source, 0)).status_code == 200
    old = state_bytes(trainer)
    encodings = [("xor", "xxh3-128"), ("overwrite", "adler32"), ("xor", "xxh3-128")]
    for version, (encoding, checksum) in enumerate(encodings, start=1):
        optimizer_step(trainer, seed=100 + version)
        new = state_bytes(trainer)
        publish(source, version, new, old, encoding, checksum)
        old = new
        pulled = await pull(client, local, source, version)
        assert pulled.status_code == 200 and pulled.json()["success"], pulled.text
        body = {"model_path": str(local), "weight_version": str(version)}
        loaded = await client.post("/update_weights_from_disk", json=body)
        assert loaded.status_code == 200, loaded.text
        scored = await client.post("/v1/logprobs", json={"tokens": [SEQUENCE]})
        got = scored.json()["outputs"][0]["log_probs"]["full"]
        assert_close(got, forward_log_probs(trainer, SEQUENCE), 1e-5)
    ready = (await client.get("/ready")).json()
    assert ready["digests"]["policy"] == codec.weights_digest(trainer.state_dict())

    # A fresh host (another local folder) catches up along the chain from the seed.
    fresh = tmp_path / "fresh"
    assert (await pull(client, fresh, source, 3)).status_code == 200
    for file in local.glob("*.safetensors"):
        assert (fresh / file.name).read_bytes() == file.read_bytes()

    # A version with one corrupt byte is refused; the local checkpoint stays at version 3.
    optimizer_step(trainer, seed=200)
    folder = publish(source, 4, state_bytes(trainer), old, "xor", "xxh3-128")
    frames = folder / "model-00000-of-00001.safetensors"
    blob = bytearray(frames.read_bytes())
    blob[-10] ^= 0x01
    frames.write_bytes(bytes(blob))
    before = {f.name: f.read_bytes() for f in local.glob("*.safetensors")}
    refused = await pull(client, local, source, 4)
    assert refused.status_code in (400, 409), refused.text
    assert refused.json()["error"]["param"] == "source_dir"
    assert {f.name: f.read_bytes() for f in local.glob("*.safetensors")} == before
    assert json.loads((local / ".weight_sync" / "state.json").read_text())["version"] == "000003"


async def test_a_missing_version_is_named(own_server, tmp_path):
    _app, client = own_server
    refused = await pull(client, tmp_path / "local", tmp_path / "nothing", 2)
    assert refused.status_code == 404
    assert refused.json()["error"]["param"] == "source_dir"


def _pull_in_child(local: str, base: str, source: str, target: int) -> None:
    from app.weights.published import pull as pulled

    pulled(Path(local), Path(base), Path(source), target)


@pytest.mark.parametrize("kill_after_s", [0.0, 0.01, 0.03, 0.06, 0.1, 0.15])
def test_a_pull_killed_at_any_point_leaves_a_whole_version(tmp_path, kill_after_s):
    """`kill -9` of the process pulling (at several moments of seeding and applying): the
    next pull gives exactly the files a pull never cut short gives."""
    import multiprocessing
    import os
    import signal
    import time

    from app.weights.published import pull as pulled

    rng = np.random.default_rng(0)
    base, source = tmp_path / "base", tmp_path / "published"
    base.mkdir()
    old = {f"t{i}": rng.integers(0, 255, 16 << 20, dtype=np.uint8) for i in range(4)}
    for i in range(2):
        names = [f"t{2 * i}", f"t{2 * i + 1}"]
        save_file({n: old[n] for n in names}, str(base / f"model-{i}.safetensors"))
    new = {n: a.copy() for n, a in old.items()}
    for array in new.values():
        array[rng.integers(0, array.size, array.size // 50)] ^= 0x5A
    publish(source, 1, new, old, "xor", "xxh3-128")
    clean = tmp_path / "clean"
    pulled(clean, base, source, 1)

    local = tmp_path / "local"
    context = multiprocessing.get_context("fork")
    child = context.Process(target=_pull_in_child, args=(str(local), str(base), str(source), 1))
    child.start()
    time.sleep(kill_after_s)
    if child.pid is not None and child.is_alive():
        os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert pulled(local, base, source, 1) == 1
    for file in clean.glob("*.safetensors"):
        assert (local / file.name).read_bytes() == file.read_bytes(), file.name
    assert sorted(p.name for p in local.iterdir()) == sorted(p.name for p in clean.iterdir())


async def test_skyrls_delta_routes_refuse_by_name(own_server, tmp_path):
    """SkyRL's checkpoint-delta calls (its own flow runs in tests/trainers/test_skyrl.py):
    a fetch without its folder, from an object store, or of a version not published is
    refused naming the field; after its init, vLLM's start and finish need no group."""
    _app, client = own_server
    missing = await client.post("/fetch_weights", json={"target_version": 1})
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "sync_dir"
    body = {"target_version": 1, "sync_dir": str(tmp_path), "uri": "gs://bucket/delta-00000001"}
    cloud = await client.post("/fetch_weights", json=body)
    assert cloud.status_code == 422 and cloud.json()["error"]["param"] == "uri"
    absent = await client.post(
        "/fetch_weights", json={"target_version": 2, "sync_dir": str(tmp_path)}
    )
    assert absent.status_code == 404, absent.text
    assert absent.json()["error"]["param"] == "sync_dir"
    assert (await client.post("/start_weight_update")).status_code == 409  # no group, no init
    init = {
        "init_info": {
            "base_model_path": "Qwen/Qwen3-0.6B",
            "local_checkpoint_dir": str(tmp_path / "theirs"),
            "cloud_download_workers": 4,
            "checkpoint_load_format": "vllm_multi_thread_safetensors",
            "multi_thread_safetensors_max_workers": 8,
        }
    }
    assert (await client.post("/init_weight_transfer_engine", json=init)).status_code == 200
    assert (await client.post("/start_weight_update")).status_code == 200
    update = {"update_info": {"target_version": 1, "version": 1, "sync_dir": str(tmp_path)}}
    refused = await client.post("/update_weights", json=update)
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["param"] == "update_info.sync_dir"
    assert (await client.post("/finish_weight_update")).status_code == 200
    assert (await client.get("/v1/weights/version")).json()["policy_version"] == 0


def test_a_trainer_counting_again_gets_its_version_rebuilt(tmp_path):
    """A local checkpoint past the target (its trainer restarted and counts from 1 again), or
    another source's: rebuilt from the seed to exactly what a fresh pull gives."""
    from app.weights.published import pull as pulled

    rng = np.random.default_rng(1)
    base, source = tmp_path / "base", tmp_path / "published"
    base.mkdir()
    versions = [{"t": rng.integers(0, 255, 4096, dtype=np.uint8)}]
    save_file(versions[0], str(base / "model.safetensors"))
    for version in (1, 2, 3):
        new = {"t": versions[-1]["t"].copy()}
        new["t"][rng.integers(0, 4096, 64)] ^= 0x11
        publish(source, version, new, versions[-1], "xor", "xxh3-128")
        versions.append(new)
    local, fresh = tmp_path / "local", tmp_path / "fresh"
    assert pulled(local, base, source, 3) == 3
    assert pulled(local, base, source, 2) == 2
    pulled(fresh, base, source, 2)
    assert (local / "model.safetensors").read_bytes() == (fresh / "model.safetensors").read_bytes()
    other = tmp_path / "other"
    shutil.copytree(source, other)
    assert pulled(local, base, other, 1) == 1  # another source's: from the seed
    pulled(tmp_path / "fresh1", base, other, 1)
    assert (local / "model.safetensors").read_bytes() == (
        tmp_path / "fresh1" / "model.safetensors"
    ).read_bytes()
