"""Weight updates through the dialects' routes, by trainers that open their groups and send
their bytes as vLLM's and SGLang's trainers do (gloo on this CPU): the served weights equal
the trainer's, one version is published per update, and the version the trainer names."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.e2e.server import free_port
from tests.e2e.trainer import grpo_step
from tests.e2e.vllm_group import gloo_group, send
from tests.weights.conftest import Served, perturbed

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [100, 101, 102, 7]]
BROADCASTER = Path(__file__).with_name("sglang_broadcaster.py")


def post(served: Served, path: str, body: Any = None) -> dict[str, Any]:
    with served.trainer_client() as client:
        response = (
            client._http.post(path, json=body) if body is not None else client._http.post(path)
        )
    assert response.status_code == 200, response.text
    return (
        response.json()
        if response.headers.get("content-type", "").startswith("application/json")
        else {}
    )


def vllm_trainer(
    served: Served,
    model: torch.nn.Module,
    packed: bool,
    version: str | None,
    shape: str = "0.32",
) -> None:
    """What TRL's VLLMClient and vLLM's NCCLTrainerWeightTransferEngine send, in order:
    vLLM 0.32's shape (`packed` on the init info), the older releases' that SkyRL drives
    (`shape` "update": packed named on each update_info), or SkyRL 0.3.0's worker methods
    through /collective_rpc ("rpc", as RemoteInferenceClient's start_weight_update,
    update_weights_nccl and finish_weight_update send them; no version named)."""
    world = post_get(served, "/get_world_size")["world_size"] + 1
    port = free_port()
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
    }
    packing = {"packed": packed, "packed_buffer_size_bytes": 1 << 18}
    if shape == "0.32":
        init_info |= packing
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(post, served, "/init_weight_transfer_engine", {"init_info": init_info})
        group = gloo_group("127.0.0.1", port, world)
        joined.result()
        tensors = list(model.state_dict().items())
        info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
        }
        if shape != "0.32":
            info |= {**packing, "packed_num_buffers": 2}
        if shape == "rpc":
            start = {
                "method": "skyrl_start_weight_update",
                "kwargs": {"is_checkpoint_format": True},
            }
            assert post(served, "/collective_rpc", start) == {"results": [None]}
            update = {"method": "update_weights_nccl", "kwargs": {"update_info": info}}
            pending = pool.submit(post, served, "/collective_rpc", update)
        else:
            post(served, "/start_weight_update", {})
            pending = pool.submit(post, served, "/update_weights", {"update_info": info})
        send(group, tensors, packed, 1 << 18)
        pending.result()
        if shape == "rpc":
            post(served, "/collective_rpc", {"method": "skyrl_finish_weight_update"})
        else:
            post(served, "/finish_weight_update", {"weight_version": version})
        post(served, "/shutdown_weight_transfer_engine")


def post_get(served: Served, path: str) -> dict[str, Any]:
    with served.trainer_client() as client:
        response = client._http.get(path)
    assert response.status_code == 200, response.text
    return response.json()


async def served_version(served: Served) -> int:
    return int((await served.http.get("/v1/weights/version")).json()["policy_version"])


async def assert_serves(served: Served, model: torch.nn.Module) -> None:
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(model, sequence), 1e-5)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "per-tensor"])
@pytest.mark.parametrize("shape", ["0.32", "update", "rpc"])
async def test_a_vllm_trainer_updates_the_served_weights(served, trainer_model, packed, shape):
    new = perturbed(trainer_model, 0.9)
    version = await served_version(served) + (3 if shape != "rpc" else 1)
    named = str(version) if shape != "rpc" else None
    await asyncio.to_thread(vllm_trainer, served, new, packed, named, shape)
    assert await served_version(served) == version
    assert (await served.http.get("/weight_info")).json() == {"weight_version": str(version)}
    await assert_serves(served, new)


async def test_collective_rpc_refuses_the_worker_methods_it_does_not_run(served):
    """SkyRL's CUDA IPC chunk, its sleep and wake: 422 naming `method` and the methods run;
    IPC handles on an update name their field; nothing is left started."""
    for body, param in [
        ({"method": "update_weights_ipc", "kwargs": {"update_info": {}}}, "method"),
        ({"method": "skyrl_sleep_for_weight_sync", "kwargs": {"offload_kv": True}}, "method"),
        ({"kwargs": {}}, "method"),
        (
            {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": False}},
            "kwargs.is_checkpoint_format",
        ),
        (
            {
                "method": "update_weights_nccl",
                "kwargs": {
                    "update_info": {
                        "names": ["w"],
                        "dtype_names": ["bfloat16"],
                        "shapes": [[2]],
                        "ipc_handles_pickled": "gAR9lC4=",
                    }
                },
            },
            "kwargs.update_info.ipc_handles_pickled",
        ),
    ]:
        refused = await served.http.post("/collective_rpc", json=body)
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["param"] == param, error
        if param == "method" and "method" in body:
            assert "update_weights_nccl" in error["message"]
    assert (await served.http.get("/v1/weights/transfer")).json()["state"] == "idle"


def sglang_update(
    bucket: list[tuple[str, torch.Tensor]], group: str, version: int
) -> dict[str, Any]:
    """SGLang's /update_weights_from_distributed body for one bucket, as slime and AReaL
    send it."""
    return {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).replace("torch.", "") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group,
        "flush_cache": False,
        "weight_version": str(version),
    }


@contextlib.contextmanager
def sglang_group(
    served: Served,
    buckets: list[tuple[bool, list[torch.Tensor]]],
    name: str,
    saved: Path,
    *flags: str,
    backend: str = "gloo",
) -> Iterator[subprocess.Popen[bytes]]:
    """An SGLang-speaking trainer's broadcasting process (sglang_broadcaster.py, with
    `flags`), which will broadcast `buckets` (saved to `saved`), and the server joined to its
    group as slime and AReaL join it (`init_weights_update_group` at rank 1)."""
    world = post_get(served, "/server_info")["tp_size"] + 1
    port = free_port()
    torch.save(buckets, saved)
    process = subprocess.Popen(
        [sys.executable, str(BROADCASTER), str(port), str(world), name, str(saved), *flags],
        stdin=subprocess.PIPE,
    )
    try:
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": world,
            "group_name": name,
            "backend": backend,
        }
        post(served, "/init_weights_update_group", body)
        yield process
        assert process.stdin is not None
        process.stdin.close()  # the flow is done: an `exit` trainer may end now
        assert process.wait(timeout=60) == 0
    finally:
        process.kill()


def sglang_trainer(
    served: Served, model: torch.nn.Module, flow: str, version: int, tmp_path: Path
) -> list[int]:
    """What slime and AReaL send (`flow` "paused": pause, buckets, continue) and SGLang 0.5.23
    asks ("session": begin, buckets, end); one bucket per tensor, one flattened. Returns the
    served version after each bucket."""
    name = "update_weight_group"
    tensors = list(model.state_dict().items())
    half = len(tensors) // 2
    buckets = [(False, tensors[:half]), (True, tensors[half:])]
    sent = [(flat, [t for _, t in bucket]) for flat, bucket in buckets]
    seen = []
    with sglang_group(served, sent, name, tmp_path / "buckets.pt"):
        post(served, "/pause_generation" if flow == "paused" else "/begin_weight_update", {})
        for flat, bucket in buckets:
            update = sglang_update(bucket, name, version)
            if flat:
                update["load_format"] = "flattened_bucket"
            post(served, "/update_weights_from_distributed", update)
            seen.append(int(post_get(served, "/get_weight_version")["weight_version"]))
        post(served, "/continue_generation" if flow == "paused" else "/end_weight_update", {})
        post(served, "/destroy_weights_update_group", {"group_name": name})
    return seen


@pytest.mark.parametrize("flow", ["paused", "session"])
async def test_an_sglang_trainer_updates_the_served_weights_at_once(
    served, trainer_model, flow, tmp_path
):
    new = perturbed(trainer_model, 1.1)
    before = await served_version(served)
    version = before + 2
    seen = await asyncio.to_thread(sglang_trainer, served, new, flow, version, tmp_path)
    assert seen == [before, before], "a bucket became visible before the update's end"
    assert await served_version(served) == version
    assert (await served.http.get("/model_info")).json()["weight_version"] == str(version)
    assert not (await served.http.get("/is_paused")).json()["is_paused"]
    await assert_serves(served, new)


async def test_an_sglang_speaking_grpo_loop_ends_serving_the_trainers_weights(
    served, trainer_model, tmp_path
):
    """Three GRPO steps as slime's loop runs them: sample groups with /generate, score them,
    step, push the weights (paused, buckets, continue); then the server serves the trainer's
    weights exactly, at the version the trainer named."""
    optimizer = torch.optim.SGD(trainer_model.parameters(), lr=0.05)
    prompts = [[5, 6, 7], [40, 41]]
    start = await served_version(served)
    for step in range(1, 4):
        body = {
            "input_ids": prompts,
            "sampling_params": {"max_new_tokens": 4, "n": 4, "sampling_seed": step},
            "return_logprob": True,
        }
        outputs = (await served.http.post("/generate", json=body)).json()
        groups = []
        for i, prompt in enumerate(prompts):
            completions = [o["output_ids"] for o in outputs[i * 4 : (i + 1) * 4]]
            rewards = [float(sum(t % 2 == 0 for t in c)) for c in completions]  # even ids
            groups.append((prompt, completions, rewards))
        await asyncio.to_thread(grpo_step, trainer_model, optimizer, groups)
        await asyncio.to_thread(
            sglang_trainer, served, trainer_model, "paused", start + step, tmp_path
        )
        assert await served_version(served) == start + step
    await assert_serves(served, trainer_model)


def joined_and_gone(served: Served, tmp_path: Path, name: str) -> None:
    """An SGLang-speaking trainer process (AReaL's vLLM flow, a slime trainer that dies) that
    joins the server's group, then ends without ever leaving it."""
    with sglang_group(served, [], name, tmp_path / f"nothing-{name}.pt", "exit"):
        pass


async def test_a_group_left_behind_never_blocks_the_next_trainer(served, trainer_model, tmp_path):
    """A trainer gone without leaving its group (AReaL's vLLM flow never leaves it): the next
    trainer, of another dialect, joins all the same, since nothing answers at the old
    group's rendezvous any more."""
    await asyncio.to_thread(joined_and_gone, served, tmp_path, "areal_weight_update_group")
    state = (await served.http.get("/v1/weights/transfer")).json()
    assert state["state"] == "joined"  # the server cannot know yet
    new = perturbed(trainer_model, 1.07)
    version = await served_version(served) + 1
    await asyncio.to_thread(vllm_trainer, served, new, True, str(version))
    assert await served_version(served) == version
    await assert_serves(served, new)


async def test_a_live_trainers_group_is_refused_to_another_until_an_admin_closes_it(
    served, tmp_path
):
    """A group whose trainer still answers at its rendezvous is not taken from it: another
    trainer's join is refused at once, naming how an admin closes the group; the close is
    answered at once too, and the first trainer's own close afterwards is harmless. The
    refused trainer, waiting as rank 0 at its own rendezvous beside its request (as slime's
    and AReaL's do, for 30 minutes by default; 60 s here), is let go at once: the server's
    stand-ins join its group and leave, so its own call reads the refusal."""
    from tests.weights.test_transfer import opened

    async with opened(served):
        port = free_port()
        torch.save([], tmp_path / "no-buckets.pt")
        trainer = subprocess.Popen(
            [
                sys.executable,
                str(BROADCASTER),
                str(port),
                "2",
                "another_trainer",
                str(tmp_path / "no-buckets.pt"),
            ]
        )
        other = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "another_trainer",
            "backend": "gloo",
        }
        started = time.monotonic()
        try:
            refused = await served.http.post("/init_weights_update_group", json=other)
            assert refused.status_code == 409, refused.text
            error = refused.json()["error"]
            assert error["param"] == "model" and "/v1/weights/transfer/close" in error["message"]
            assert await asyncio.to_thread(trainer.wait, 30) == 0
            assert time.monotonic() - started < 30  # (its own rendezvous waits 60 s)
        finally:
            trainer.kill()
        closed = await served.http.post("/v1/weights/transfer/close", json={"model": "policy"})
        assert closed.status_code == 200 and closed.json()["state"] == "idle"
        assert time.monotonic() - started < 10
    state = (await served.http.get("/v1/weights/transfer")).json()
    assert state["state"] == "idle"


async def test_a_group_idle_past_the_operators_timeout_is_closed(served, caplog):
    from tests.weights.test_transfer import opened

    groups = served.app.state.weights.transfers.groups
    groups.idle_timeout_s = 1.0  # weights.group_idle_timeout_s
    try:
        async with opened(served):
            state = (await served.http.get("/v1/weights/transfer")).json()
            assert state["state"] == "joined"
            async with asyncio.timeout(10):
                while state["state"] != "idle":
                    await asyncio.sleep(0.1)
                    state = (await served.http.get("/v1/weights/transfer")).json()
    finally:
        groups.idle_timeout_s = None
    assert "no call from its trainer" in caplog.text
