"""Which engines serve LoRA adapters: the vLLM backend refuses them by name (vLLM's CPU build
is not wired to rlserve's adapters yet), rather than serving the policy under an adapter's
name."""

from __future__ import annotations


async def test_an_engine_without_adapters_refuses_them_by_name(client, backend_name, tmp_path):
    response = await client.post("/v1/adapters", json={"name": "a", "path": str(tmp_path)})
    error = response.json()["error"]
    if backend_name == "vllm":
        assert response.status_code == 422 and error["param"] == "path"
        assert "serves no LoRA adapters" in error["message"]
    else:  # the transformers backend reads the folder (an empty one here)
        assert response.status_code == 404 and "adapter_config.json" in error["message"]
    models = await client.post("/v1/logprobs", json={"model": "a", "tokens": [[1, 2, 3]]})
    assert models.status_code == 422 and models.json()["error"]["param"] == "model"
