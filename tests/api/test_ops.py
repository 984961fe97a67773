"""Health, readiness and the model list, including while the model is still loading."""

from __future__ import annotations

import asyncio

import httpx
from rlserve_client.weight_delta import weights_digest

from app.config import Settings
from app.main import create_app


async def test_health_ready_models(client, model_dir, backend_name, hf_model):
    assert (await client.get("/health")).json() == {"status": "ok", "model_status": "ready"}
    assert (await client.get("/live")).json() == {"status": "ok", "model_status": "ready"}
    ready = (await client.get("/ready")).json()
    digests = ready.pop("digests")
    assert ready == {
        "ready": True,
        "policy_version": 0,
        "paused": False,
        "pause_mode": None,
        "lineage": {"number": 0, "since_version": 0, "trainer_version": None},
    }
    # Each model's digest is its checkpoint's own (vLLM's read from the files it serves).
    own = weights_digest(hf_model.state_dict())
    assert digests == {"policy": own, "reference": own}
    body = (await client.get("/v1/models")).json()
    card, reference = body["models"]
    assert (card["name"], reference["name"]) == ("policy", "reference")
    assert reference["source"] == card["source"]  # by default a frozen copy of the policy
    assert card["source"] == str(model_dir)
    assert card["backend"] == backend_name
    assert card["dtype"] == "float32"
    # vLLM scores with one extra (generated) token, so it scores one token less.
    assert card["max_model_len"] == (4095 if backend_name == "vllm" else 4096)
    assert card["vocab_size"] == 259
    assert card["builtin"] is True


async def test_not_ready_until_loaded_and_failure_is_reported(tmp_path):
    settings = Settings(
        models={
            "cache_dir": tmp_path,
            "model": str(tmp_path / "does-not-exist"),
            "exit_on_load_failure": False,
        }
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            # loading: alive (/live), not serving (/health as vLLM's, /v1/models: never empty)
            live = await client.get("/live")
            assert live.status_code == 200 and live.json()["model_status"] in ("loading", "failed")
            for path in ("/health", "/v1/models"):
                loading = await client.get(path)
                assert loading.status_code == 503, (path, loading.text)
                assert loading.json()["error"]["type"] == "unavailable_error"
            await asyncio.wait_for(app.state.loading, timeout=60)
            ready = await client.get("/ready")
            assert ready.status_code == 503
            assert "failed" in ready.json()["error"]["message"]
            response = await client.post("/v1/logprobs", json={"tokens": [[1, 2]]})
            assert response.status_code == 503
            assert response.json()["error"]["type"] == "unavailable_error"
            assert (await client.get("/live")).json()["model_status"] == "failed"
            failed = await client.get("/health")
            assert failed.status_code == 503 and "failed" in failed.json()["error"]["message"]


async def test_unknown_route_uses_the_error_body(client):
    response = await client.get("/v1/nothing-here")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404
