"""The trainers' NCCL transports, on a GPU host (`scripts/gpu-check.sh --trainers`): what the
CPU suite runs over gloo, over NCCL. NCCL puts each rank on a GPU of its own, so these need
two CUDA devices (the server on the first, the trainer on the last). slime's is torch's own
NCCL group; SkyRL's is vLLM's NCCL engine on both sides, so it also needs vllm and SkyRL 0.3.0
importable. Each test skips saying what is missing; CI never has a GPU. ART's training step
needs ART's own GPU stack (unsloth and its vLLM), which a lent machine without a network
cannot install: its CPU test covers everything but the optimizer step."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from app.config import Settings
from app.main import create_app
from tests.conftest import assert_close, forward_log_probs, started
from tests.e2e.server import running_server
from tests.weights.conftest import Served, perturbed
from tests.weights.test_dialect_transfer import SEQUENCES
from tests.weights.test_slime_replay import slime_trainer_process

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def needs_two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank: two CUDA devices (server and trainer)")


@pytest.fixture
async def on_gpu(settings: Settings) -> AsyncIterator[Served]:
    needs_two_gpus()
    app = create_app(
        settings.replace(
            models={"device": "cuda:0", "load_reference": False},
            storage={"data_dir": settings.storage.data_dir / "gpu-transports"},
        )
    )
    async with app.router.lifespan_context(app):
        await started(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            yield Served(app, c, asyncio.get_running_loop())


async def test_slimes_distributed_updates_over_nccl(on_gpu, model_dir, tmp_path):
    """A slime trainer process's pushes over its NCCL group (init_custom_process_group's
    recipe), on the trainer's GPU: each is served exactly."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pushes = [perturbed(trainer, 1.03), perturbed(trainer, 0.98)]
    await asyncio.to_thread(slime_trainer_process, on_gpu, pushes, tmp_path, "slime-pp_0", "nccl")
    body = await on_gpu.http.post("/v1/logprobs", json={"tokens": SEQUENCES})
    for sequence, output in zip(SEQUENCES, body.json()["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(pushes[-1], sequence), 1e-4)


def test_skyrl_030s_weight_sync_over_vllms_nccl_engine(tmp_path):
    """SkyRL 0.3.0's sender whole (`create_sender`: vLLM's NCCL trainer engine), three GRPO
    steps, against a server on the first GPU joining with vLLM's NCCL communicator."""
    needs_two_gpus()
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("SkyRL's transport is vLLM's NCCL engine: vllm is not installed")
    skyrl = os.environ.get("RLSERVE_SKYRL_030", str(ROOT / ".venv-skyrl" / "skyrl-0.3.0"))
    if not Path(skyrl, "skyrl").is_dir():
        pytest.skip(f"no SkyRL 0.3.0 at {skyrl} (RLSERVE_SKYRL_030)")
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_MODELS__DEVICE": "cuda:0",
    }
    with running_server(env=env, log=tmp_path / "server.log") as server:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        driver = ROOT / "tests" / "trainers" / "skyrl030_driver.py"
        stop = str(card["pad_token_id"])
        ran = subprocess.run(
            [sys.executable, str(driver), server.url, "policy", stop, card["source"], "--nccl"],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": f"{skyrl}{os.pathsep}{ROOT}"},
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        out = json.loads(ran.stdout.strip().splitlines()[-1])
        for step in out["steps"]:
            for sampled, own in zip(step["sampled"], step["own"], strict=True):
                assert_close(sampled, own, 1e-3)
        assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": "3"}


async def test_deltas_over_nccl_serve_the_trainers_weights(on_gpu, model_dir):
    """`weight_transfer(deltas=True)` from a trainer on the second GPU: the first push whole,
    then deltas as one uint8 tensor over NCCL, each served exactly."""
    from transformers import AutoModelForCausalLM

    from tests.weights.test_transfer_deltas import step

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    trainer = trainer.to("cuda:1")

    def pushes() -> list[Any]:
        torch.cuda.set_device(1)  # (this thread's NCCL rank)
        with (
            on_gpu.trainer_client() as client,
            client.weight_transfer(master_address="127.0.0.1", deltas=True) as sync,
        ):
            sent = []
            for seed in range(3):
                step(trainer, seed)
                sent.append(sync.send(trainer))
            return sent

    sent = await asyncio.to_thread(pushes)
    assert sent[0].sent_bytes is None and all(s.sent_bytes for s in sent[1:])
    expected = trainer.to("cpu")
    body = await on_gpu.http.post("/v1/logprobs", json={"tokens": SEQUENCES})
    for sequence, output in zip(SEQUENCES, body.json()["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(expected, sequence), 1e-4)
