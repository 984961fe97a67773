"""prime-rl's admin requests to its vLLM server, replayed as exact request bodies: prime-rl is
not on PyPI, so its client cannot be imported. Source: PrimeIntellect-ai/prime-rl at commit
559b44772e471d1538537b8805cc77f3824a5e64 (main): `src/prime_rl/utils/client.py`
(`wait_for_ready`'s /health and /v1/models; `update_weights`: `/pause?mode=keep&clear_cache=
false`, `/update_weights {"weight_dir"}`, `/resume`; `init_nccl_broadcast`'s
`/init_broadcaster` body) and, for its NCCL broadcast mode, the trainer's side,
`src/prime_rl/transports/weights/nccl.py` (`NCCLWeightBroadcastSender.broadcast_weights`:
the chunk count, then per chunk `broadcast_state_dict`: a pickled {dtype: [(name, shape,
numel)]} and one flat tensor per dtype; non-layer weights first, then layer by layer). Its
generation goes through renderers (see tests/trainers/test_renderers.py).

The one change: prime-rl's trainer and workers join vLLM's StatelessProcessGroup with a
PyNcclCommunicator, NCCL only; on this CPU the trainer's group is vLLM's gloo one
(tests/e2e/vllm_group.py), the same broadcasts over it."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import pickle
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import assert_close, forward_log_probs, served_app
from tests.e2e.server import free_port
from tests.e2e.vllm_group import broadcast, gloo_group

NAME = "prime/policy"


@pytest.fixture
async def server(settings) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    models = {"served_model_name": [NAME], "load_reference": False}
    data_dir = settings.storage.data_dir / "prime-rl"
    async with served_app(settings.replace(models=models, storage={"data_dir": data_dir})) as c:
        yield c


async def test_prime_rls_admin_loop_loads_each_step(server, model_dir, tmp_path):
    # wait_healthy, check_model
    assert (await server.get("/health")).status_code == 200
    models = (await server.get("/v1/models")).json()["data"]
    assert any(m["id"] == NAME for m in models)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.02)
        step_dir = tmp_path / f"step_{step}"
        model.save_pretrained(step_dir)
        # on_new_version, filesystem mode: pause (keep), update from the step's folder, resume
        paused = await server.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert paused.status_code == 200, paused.text
        loaded = await server.post("/update_weights", json={"weight_dir": str(step_dir)})
        assert loaded.status_code == 200, loaded.text
        assert (await server.post("/resume")).status_code == 200
        sequence = [5, 6, 7, 8, 9]
        body = (await server.post("/v1/logprobs", json={"tokens": [sequence]})).json()
        assert_close(
            body["outputs"][0]["log_probs"]["full"], forward_log_probs(model, sequence), 1e-4
        )
    missing = await server.post("/update_weights", json={"weight_dir": str(tmp_path / "none")})
    assert missing.status_code == 404
    both = await server.post(
        "/update_weights",
        json={
            "weight_dir": str(step_dir),
            "update_info": {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]},
        },
    )
    assert both.status_code == 422 and both.json()["error"]["param"] == "update_info"


def broadcast_state_dict(group: Any, state: dict[str, torch.Tensor]) -> None:
    """prime-rl's `broadcast_state_dict`: its metadata, then one flat tensor per dtype."""
    dtype_groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for key, value in state.items():
        dtype_groups.setdefault(value.dtype, []).append((key, value))
    metadata = {
        dtype: [(key, value.shape, value.numel()) for key, value in items]
        for dtype, items in dtype_groups.items()
    }
    raw = pickle.dumps(metadata)
    broadcast(group, torch.tensor([len(raw)], dtype=torch.long))
    broadcast(group, torch.ByteTensor(list(raw)))
    for items in dtype_groups.values():
        broadcast(group, torch.cat([value.flatten() for _, value in items]))


def broadcast_weights(group: Any, model: torch.nn.Module) -> None:
    """prime-rl's `broadcast_weights` on the trainer's master rank: the chunk count (layers
    and one), the non-layer weights, then each layer's (`filter_state_dict_by_layers`)."""
    state = {key: value.detach() for key, value in model.state_dict().items()}
    prefix = "model.layers."
    layers = 1 + max(int(k[len(prefix) :].split(".")[0]) for k in state if k.startswith(prefix))
    chunks = [{k: v for k, v in state.items() if not k.startswith(prefix)}]
    chunks += [
        {k: v for k, v in state.items() if k.startswith(f"{prefix}{i}.")} for i in range(layers)
    ]
    broadcast(group, torch.tensor([len(chunks)], dtype=torch.long))
    for chunk in chunks:
        broadcast_state_dict(group, chunk)


async def test_prime_rls_nccl_broadcast_mode_receives_each_step(
    server, model_dir, tmp_path, caplog
):
    """prime-rl's NCCL broadcast mode: the orchestrator joins the server to the trainer's
    group (/init_broadcaster), then each step pauses, asks /update_weights with the step's
    folder (empty: the weights come over the group, named there) while the trainer
    broadcasts, and resumes. Each step then serves the trainer's weights, one version each."""
    port = free_port()
    body = {
        "host": "127.0.0.1",
        "port": port,
        "rank_offset": 0,
        "inference_world_size": 1,
        "timeout": 60,
        "quantize_in_weight_transfer": False,
    }
    joined = asyncio.create_task(server.post("/init_broadcaster", json=body))
    group = await asyncio.to_thread(gloo_group, "127.0.0.1", port, 2)
    answer = await joined
    assert answer.status_code == 200 and answer.json() == {"status": "ok"}, answer.text
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    before = (await server.get("/v1/weights/version")).json()["policy_version"]
    for step in (1, 2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * 0.02)
        step_dir = tmp_path / "broadcasts" / f"step_{step}"
        os.makedirs(step_dir)  # the orchestrator's NCCL_READY goes here; no weights
        (step_dir / "NCCL_READY").touch()
        paused = await server.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert paused.status_code == 200, paused.text
        sent = asyncio.create_task(asyncio.to_thread(broadcast_weights, group, model))
        loaded = await server.post("/update_weights", json={"weight_dir": str(step_dir)})
        await sent
        assert loaded.status_code == 200, loaded.text
        assert (await server.post("/resume")).status_code == 200
        sequence = [5, 6, 7, 8, 9]
        scored = (await server.post("/v1/logprobs", json={"tokens": [sequence]})).json()
        assert_close(
            scored["outputs"][0]["log_probs"]["full"], forward_log_probs(model, sequence), 1e-5
        )
        assert scored["policy_version"] == before + step

    # The trainer's run ends (prime-rl has no call that leaves the group): its rendezvous
    # goes with it. The next step from a folder loads the folder, at the first try (prime-rl
    # retries a 5xx, which would hide a failed first one).
    group.shutdown()
    del group
    gc.collect()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.02)
    model.save_pretrained(tmp_path / "step_3")
    with caplog.at_level(logging.WARNING):
        loaded = await server.post("/update_weights", json={"weight_dir": str(tmp_path / "step_3")})
    assert loaded.status_code == 200, loaded.text
    assert "is gone (nothing accepts connections at its rendezvous)" in caplog.text
    assert (await server.get("/v1/weights/transfer")).json()["state"] == "idle"
    scored = (await server.post("/v1/logprobs", json={"tokens": [sequence]})).json()
    assert_close(
        scored["outputs"][0]["log_probs"]["full"], forward_log_probs(model, sequence), 1e-5
    )


async def test_a_broadcast_naming_anything_but_the_models_tensors_is_refused(server, tmp_path):
    """The metadata of prime-rl's broadcast is a pickle: read with torch's dtypes and sizes
    alone allowed, never code; a tensor the model does not have is refused before its bytes
    are taken. Either way the update is refused naming `weights`, nothing changes, and the
    group is left (the trainer's broadcasts are out of step)."""

    class Planted:
        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    before = (await server.get("/v1/weights/version")).json()["policy_version"]
    for metadata, said in (
        ({torch.float32: [("lm_head.extra", torch.Size([2]), 2)]}, "unknown parameter"),
        ({torch.float32: [(Planted(), torch.Size([2]), 2)]}, "only torch's dtypes"),
    ):
        port = free_port()
        body = {"host": "127.0.0.1", "port": port, "inference_world_size": 1, "timeout": 30}
        joined = asyncio.create_task(server.post("/init_broadcaster", json=body))
        group = await asyncio.to_thread(gloo_group, "127.0.0.1", port, 2)
        assert (await joined).status_code == 200

        def trainer(group: Any = group, metadata: Any = metadata) -> None:
            raw = pickle.dumps(metadata)
            broadcast(group, torch.tensor([1], dtype=torch.long))
            broadcast(group, torch.tensor([len(raw)], dtype=torch.long))
            broadcast(group, torch.ByteTensor(list(raw)))

        sent = asyncio.create_task(asyncio.to_thread(trainer))
        refused = await server.post("/update_weights", json={"weight_dir": str(tmp_path)})
        await sent
        assert refused.status_code == 422, refused.text
        error = refused.json()["error"]
        assert error["param"] == "weights" and said in error["message"]
        state = (await server.get("/v1/weights/transfer")).json()
        assert state["state"] == "idle"
    assert not (tmp_path / "ran").exists()
    assert (await server.get("/v1/weights/version")).json()["policy_version"] == before
