"""16 concurrent /v1/logprobs requests to a real server equal the same requests one by one."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.conftest import assert_close
from tests.e2e.server import running_server

pytestmark = pytest.mark.slow


async def test_concurrent_equals_sequential_over_http(tmp_path):
    env = {
        "RLSERVE_MODELS__CACHE_DIR": str(tmp_path / "cache"),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path / "data"),
        "RLSERVE_BATCHING__MAX_BATCH_SIZE": "8",
    }
    sequences = [[(11 * i + 3 * j) % 256 for j in range(20 + 13 * i)] for i in range(16)]
    with running_server(env=env, log=tmp_path / "server.log") as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            sequential = []
            for seq in sequences:
                body = (await client.post("/v1/logprobs", json={"tokens": [seq]})).json()
                sequential.append(body["outputs"][0]["log_probs"]["full"])
            concurrent = await asyncio.gather(
                *(client.post("/v1/logprobs", json={"tokens": [seq]}) for seq in sequences)
            )
            state = (await client.get("/v1/batching")).json()["models"]["policy"]["score"]
    for response, expected in zip(concurrent, sequential, strict=True):
        assert response.status_code == 200
        assert_close(response.json()["outputs"][0]["log_probs"]["full"], expected, 1e-5)
    assert state["num_items"] == 32
    assert max(state["last_batch_sizes"]) > 1
    assert max(state["last_batch_sizes"]) <= 8
