"""slime's disk delta mode written by slime's own writer: `UpdateWeightFromDiskDelta`
(`slime/backends/megatron_utils/update_weight/update_weight_from_disk_delta.py`, unmodified)
captures its baseline from the served checkpoint, then per step diffs the trainer's weights,
writes the version folder (`_encode_delta`, `_write_delta_files`) and reloads the engine
(`_reload_engines`: `/pull_weights`, pause, flush, `/update_weights_from_disk`, continue)
against a real rlserve; served log-probs equal the trainer's forward at every version.

What stands in for the parts of a slime job that are not the writer: Megatron's parallel
state (`mpu`: one rank, data and tensor parallel rank 0), the base class's gather of the HF
tensors (`UpdateWeightFromDistributed`, whose module imports Megatron's HF conversion: here
the trainer's tensors under their checkpoint names, as that gather yields them), and the Ray
actor of the engine (`SGLangEngine`, whose module imports SGLang: its requests replayed as
slime 624b824a makes them, each `.remote()` answered at once, with `ray.get` taking the
answers as they are), and the accelerator (the host, given to slime's `set_accelerator`).
The gloo group is slime's own `get_gloo_group`, over a real one-rank group. slime is on no
package registry: this runs where `SLIME_SOURCE` names a checkout of THUDM/slime (checked at
`624b824a`), and skips elsewhere, CI included (`tests/weights/test_pull_weights.py` runs the
same folders, written as the writer lays them out, in CI)."""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
import warnings
from argparse import Namespace
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import free_port
from tests.trainers.conftest import served_beside
from tests.weights.test_deltas import optimizer_step

pytestmark = pytest.mark.trainers
SOURCE = os.environ.get("SLIME_SOURCE")
if not SOURCE:
    pytest.skip("SLIME_SOURCE names no slime checkout", allow_module_level=True)
sys.path.insert(0, SOURCE)
WRITER = "slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta"
BASE = "slime.backends.megatron_utils.update_weight.update_weight_from_distributed"
SEQUENCES = [[3, 9, 27, 81, 243, 17, 5], [40, 41, 42, 43]]


class Gathered:
    """`UpdateWeightFromDistributed` as far as the disk delta writer uses it: its attributes,
    and its gather passes yielding the HF tensors (non-expert ones in one chunk; no experts)."""

    def __init__(self, args, model, weights_getter, *, model_name, quantization_config):  # type: ignore[no-untyped-def]
        self.args = args
        self.model = model
        self.model_name = model_name
        self.quantization_config = quantization_config
        self.weight_version = 0
        self._model_update_groups = None
        self.update_weight_metrics: dict[str, float] = {}
        self._weights_getter = weights_getter

    def _iter_non_expert_chunks(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        yield list(self._weights_getter().items())

    def _iter_expert_chunks(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return iter(())


class Call:
    """`engine.method.remote(...)`: the request made at once, its answer returned."""

    def __init__(self, send: Any) -> None:
        self.remote = send


class Engine:
    """`SGLangEngine`'s calls the writer makes, as slime 624b824a makes them (`_make_request`
    with its raise_for_status; pause and continue posting {}; flush_cache's GET until 200)."""

    def __init__(self, url: str, args: Namespace) -> None:
        self.url, self.args = url, args
        self.pull_weights = Call(self._pull_weights)
        self.pause_generation = Call(lambda: self._post("pause_generation", {}))
        self.continue_generation = Call(lambda: self._post("continue_generation", {}))
        self.flush_cache = Call(self._flush_cache)
        self.update_weights_from_disk = Call(self._update_weights_from_disk)
        self.pulled: list[int] = []

    def _post(self, endpoint: str, payload: dict[str, Any]) -> Any:
        response = requests.post(f"{self.url}/{endpoint}", json=payload or {})
        response.raise_for_status()
        return response.json()

    def _pull_weights(self, target_version: int) -> Any:
        self.pulled.append(target_version)
        return self._post(
            "pull_weights",
            {
                "local_checkpoint_dir": self.args.update_weight_local_checkpoint_dir,
                "source_dir": self.args.update_weight_disk_dir,
                "target_version": target_version,
            },
        )

    def _flush_cache(self) -> None:
        for _ in range(60):
            if requests.get(f"{self.url}/flush_cache").status_code == 200:
                return
        raise TimeoutError("Timeout while flushing cache.")

    def _update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        payload: dict[str, Any] = {"model_path": model_path}
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return self._post("update_weights_from_disk", payload)


def checkpoint_names(folder: Path) -> set[str]:
    """The tensors of a checkpoint (a tied output head is not one of them)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as opened:
            names |= set(opened.keys())
    return names


def host_accelerator() -> Any:
    """The host as slime's accelerator (slime's registry knows CUDA and MUSA; its
    `set_accelerator` takes any): the writer asks it for its device and stream."""
    from slime.utils.accelerator.torch_accelerator import TorchAccelerator

    class Host(TorchAccelerator):  # type: ignore[misc]
        name = device_type = "cpu"
        communication_backend_name = "gloo"

        def _module(self) -> Any:
            return torch.cpu

        def current_device(self) -> Any:
            return "cpu"

    return Host()


@pytest.fixture
def writer_class(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    """slime's writer, imported with the stand-ins above, on a one-rank gloo group."""
    megatron, core = types.ModuleType("megatron"), types.ModuleType("megatron.core")
    core.mpu = types.SimpleNamespace(  # type: ignore[attr-defined]
        get_data_parallel_rank=lambda with_context_parallel=False: 0,
        get_tensor_model_parallel_rank=lambda: 0,
    )
    megatron.core = core  # type: ignore[attr-defined]
    base = types.ModuleType(BASE)
    base.UpdateWeightFromDistributed = Gathered  # type: ignore[attr-defined]
    for name, module in (("megatron", megatron), ("megatron.core", core), (BASE, base)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, WRITER, raising=False)
    with warnings.catch_warnings():  # (slime's Megatron grad patch: no Megatron to patch)
        warnings.filterwarnings("ignore", "slime grad coalesce patch not applied")
        writer = importlib.import_module(WRITER)
    monkeypatch.setattr(writer.ray, "get", lambda answers: answers)
    distributed_utils = importlib.import_module("slime.utils.distributed_utils")
    accelerator = importlib.import_module("slime.utils.accelerator")
    accelerator.set_accelerator(host_accelerator())
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        world_size=1,
        rank=0,
        timeout=timedelta(seconds=60),
    )
    try:
        distributed_utils.set_gloo_group(dist.new_group(backend="gloo"))
        yield writer.UpdateWeightFromDiskDelta
    finally:
        distributed_utils.set_gloo_group(None)
        accelerator.reset_accelerator()
        dist.destroy_process_group()


@pytest.mark.parametrize(("encoding", "checksum"), [("xor", "xxh3-128"), ("overwrite", "adler32")])
def test_slimes_writer_publishes_versions_rlserve_pulls_and_serves(
    writer_class: type, tmp_path: Path, encoding: str, checksum: str
) -> None:
    with served_beside(tmp_path) as server:
        checkpoint = requests.get(f"{server.url}/get_model_info").json()["model_path"]
        names = checkpoint_names(Path(checkpoint))
        trainer = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

        def gathered() -> dict[str, torch.Tensor]:
            # (new buffers, as the all-gather gives: on a GPU, the writer's copy to the host
            # is one too; a CPU tensor's numpy view would alias the live parameter)
            return {n: t.detach().clone() for n, t in trainer.state_dict().items() if n in names}

        args = Namespace(
            update_weight_disk_dir=str(tmp_path / "published"),
            update_weight_delta_encoding=encoding,
            update_weight_delta_checksum=checksum,
            custom_update_weight_post_write_path=None,
            hf_checkpoint=checkpoint,
            update_weight_local_checkpoint_dir=str(tmp_path / "local"),
        )
        engine = Engine(server.url, args)
        updater = writer_class(
            args, [trainer], gathered, model_name="qwen2", quantization_config=None
        )
        updater.connect_rollout_engines([engine], rollout_engine_lock=None)
        updater.update_weights()  # the baseline: the engine seeds its local checkpoint
        assert engine.pulled == [0]
        for step in range(1, 4):
            optimizer_step(trainer, seed=300 + step)
            updater.update_weights()
            folder = tmp_path / "published" / f"weight_v{step:06d}"
            index = json.loads((folder / "model.safetensors.index.json").read_text())
            assert index["metadata"]["delta_encoding"] == encoding
            assert index["metadata"]["checksum_format"] == checksum
            assert 0 < updater.changed_bytes < updater.total_bytes / 5  # a sparse step
            version = requests.get(f"{server.url}/get_weight_version").json()
            assert version["weight_version"] == str(step)
            scored = httpx.post(
                f"{server.url}/v1/logprobs", json={"tokens": SEQUENCES}, timeout=60
            ).json()
            for sequence, output in zip(SEQUENCES, scored["outputs"], strict=True):
                assert_close(
                    output["log_probs"]["full"], forward_log_probs(trainer, sequence), 1e-5
                )
        assert engine.pulled == [0, 1, 2, 3]
        assert requests.get(f"{server.url}/ready").json()["paused"] is False
