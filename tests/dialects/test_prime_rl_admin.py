"""prime-rl's admin requests to its vLLM server, replayed as exact request bodies: prime-rl is
not on PyPI, so its client cannot be imported. Source: PrimeIntellect-ai/prime-rl,
`src/prime_rl/orchestrator/inference_admin.py` at commit
07858eec2de41fc8ca2a5725a9ba1dc6f40b2502 (`InferenceAdmin`: `wait_healthy`, `check_model`,
`on_new_version` in filesystem mode). Its generation goes through renderers (see
tests/trainers/test_renderers.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from app.main import create_app
from tests.conftest import assert_close, forward_log_probs, started

NAME = "prime/policy"


@pytest.fixture
async def server(settings) -> AsyncIterator[httpx.AsyncClient]:  # type: ignore[no-untyped-def]
    app = create_app(
        settings.replace(
            models={"served_model_name": [NAME], "load_reference": False},
            storage={"data_dir": settings.storage.data_dir / "prime-rl"},
        )
    )
    async with app.router.lifespan_context(app):
        await started(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://p") as client:
            yield client


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
