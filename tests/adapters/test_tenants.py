"""Several trainers on one server, each with its own LoRA adapter: a first upload serves an
adapter (its config in the file's metadata) owned by the uploading key; only that key or an
admin key may push to it, pause it, resume it or unload it; and pausing one adapter holds back
its requests alone, while the policy and the other adapters serve on. PEFT computes the
expected log-probs (an independent implementation)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from peft import PeftModel, get_peft_model_state_dict
from rlserve_client import AsyncClient, PermissionDeniedError
from rlserve_client.lora import adapter_file
from safetensors.torch import save

from app.config import Settings
from tests.adapters.models import peft_model
from tests.conftest import forward_log_probs, served_app

TRAINER_A, TRAINER_B, ADMIN = "trainer-a-key", "trainer-b-key", "admin-key"
SEQUENCES = [[1, 5, 9, 13, 22, 7, 3], [4, 4, 8, 100, 2]]
PROMPT = [3, 14, 15, 92, 65]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def trained(model_dir: Path) -> dict[str, PeftModel]:
    return {
        "a": peft_model(model_dir, 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        # per-layer rank and alpha, rsLoRA: what only the config says
        "b": peft_model(
            model_dir,
            2,
            r=8,
            lora_alpha=16,
            target_modules=["up_proj", "down_proj", "o_proj"],
            rank_pattern={"down_proj": 2},
            alpha_pattern={"up_proj": 4},
            use_rslora=True,
        ),
        "a-next": peft_model(model_dir, 3, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        storage={"data_dir": settings.storage.data_dir / "tenants"},
        auth={"api_keys": [TRAINER_A, TRAINER_B], "admin_api_keys": [ADMIN]},
    )
    async with served_app(config) as c:
        yield c


def api(client: httpx.AsyncClient, key: str) -> AsyncClient:
    transport = httpx.ASGITransport(app=client.app)  # type: ignore[attr-defined]
    return AsyncClient(base_url="http://rlserve", api_key=key, transport=transport)


async def log_probs(client: httpx.AsyncClient, model: str, key: str) -> list[list[float]]:
    body = {"model": model, "tokens": SEQUENCES}
    response = await client.post("/v1/logprobs", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    return [output["log_probs"]["full"] for output in response.json()["outputs"]]


def assert_peft(served: list[list[float]], model: PeftModel) -> None:
    for sequence, values in zip(SEQUENCES, served, strict=True):
        expected = forward_log_probs(model, sequence)
        assert max(abs(x - y) for x, y in zip(values, expected, strict=True)) < 1e-5


async def test_a_first_upload_serves_an_adapter_owned_by_its_key(client, trained):
    async with api(client, TRAINER_A) as a, api(client, TRAINER_B) as b:
        served = await a.push_adapter(name="tenant-a", payload=adapter_file(trained["a"]))
        assert (served.version, served.source, served.rank) == (0, "upload", 4)
        other = await b.push_adapter(name="tenant-b", payload=adapter_file(trained["b"]))
        assert (other.version, other.rank) == (0, 8)
        # what the config alone says (rank and alpha patterns, rsLoRA) is served as PEFT does
        assert_peft(await log_probs(client, "tenant-a", TRAINER_B), trained["a"])
        assert_peft(await log_probs(client, "tenant-b", TRAINER_A), trained["b"])

        # the owner's next push: tensors alone (the config served stays), its next version
        tensors = save(get_peft_model_state_dict(trained["a-next"]))
        assert (await a.push_adapter(name="tenant-a", payload=tensors)).version == 1
        assert_peft(await log_probs(client, "tenant-a", TRAINER_A), trained["a-next"])

        # another key may use it, and nothing more
        refusals: list[tuple[str, str, dict[str, Any]]] = [
            ("PUT", "/v1/adapters/tenant-a", {"content": tensors}),
            ("POST", "/v1/adapters/tenant-a/pause", {"json": {"mode": "wait"}}),
            ("POST", "/v1/adapters/tenant-a/resume", {}),
            ("DELETE", "/v1/adapters/tenant-a", {}),
        ]
        for method, path, body in refusals:
            refused = await client.request(method, path, headers=bearer(TRAINER_B), **body)
            assert refused.status_code == 403, (path, refused.text)
            error = refused.json()["error"]
            assert error["param"] == "name" and "another API key" in error["message"]
        with pytest.raises(PermissionDeniedError):
            await b.push_adapter(name="tenant-a", payload=adapter_file(trained["a"]))
        registry = client.app.state.registry
        assert registry.adapters["tenant-a"].version == 1
        assert registry.adapter_state("tenant-a").paused is None

        # a tensors-only upload cannot serve a new name: it says what is missing
        unknown = await client.put(
            "/v1/adapters/nameless", content=tensors, headers=bearer(TRAINER_A)
        )
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "name"
        assert "adapter_config" in unknown.json()["error"]["message"]

    async with api(client, ADMIN) as admin:  # an admin key may change every adapter
        assert (await admin.pause_adapter(name="tenant-a", mode="keep")).paused == "keep"
        assert (await admin.resume_adapter(name="tenant-a")).paused is None
        assert (await admin.unload_adapter(name="tenant-b")).name == "tenant-b"
    # with the name free again, another key may serve it (its versions go on counting)
    async with api(client, TRAINER_A) as a:
        again = await a.push_adapter(name="tenant-b", payload=adapter_file(trained["b"]))
        assert again.version == 1
        await a.unload_adapter(name="tenant-b")
        await a.unload_adapter(name="tenant-a")


async def generate(client: httpx.AsyncClient, model: str, tokens: int, key: str) -> Any:
    body = {"model": model, "tokens": [PROMPT], "max_new_tokens": tokens, "ignore_eos": True}
    response = await client.post("/v1/generate", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    return response.json()["outputs"][0][0]


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def test_pausing_one_adapter_holds_back_its_requests_alone(client, trained):
    registry = client.app.state.registry
    async with api(client, TRAINER_A) as a, api(client, TRAINER_B) as b:
        await a.push_adapter(name="paused", payload=adapter_file(trained["a"]))
        await b.push_adapter(name="serving", payload=adapter_file(trained["b"]))
        assert (await a.pause_adapter(name="paused", mode="wait")).paused == "wait"

        held = asyncio.ensure_future(generate(client, "paused", 4, TRAINER_A))
        await until(lambda: registry.adapter_state("paused").waiting == 1)
        # the policy and the other adapter serve on, and a global pause is not held up
        assert len((await generate(client, "serving", 4, TRAINER_B))["tokens"]["response"]) == 4
        assert len((await generate(client, "policy", 4, TRAINER_B))["tokens"]["response"]) == 4
        paused = await client.post("/v1/pause", json={"mode": "wait"}, headers=bearer(ADMIN))
        assert paused.json()["paused"] and paused.json()["in_flight_generations"] == 0
        await client.post("/v1/resume", headers=bearer(ADMIN))
        listed = {x.name: x for x in (await b.adapters()).adapters}
        assert (listed["paused"].paused, listed["paused"].waiting) == ("wait", 1)
        assert listed["serving"].paused is None
        assert not held.done()

        resumed = await a.resume_adapter(name="paused")
        assert resumed.paused is None
        assert len((await held)["tokens"]["response"]) == 4

        # abort: the adapter's generation in flight ends at its next token; the other's not
        long_a = asyncio.ensure_future(generate(client, "paused", 400, TRAINER_A))
        long_b = asyncio.ensure_future(generate(client, "serving", 300, TRAINER_B))
        await until(lambda: registry.adapter_state("paused").in_flight == 1)
        await until(lambda: registry.adapter_state("serving").in_flight == 1)
        aborted = await a.pause_adapter(name="paused", mode="abort")
        assert (aborted.paused, aborted.in_flight) == ("abort", 0)
        cut = await long_a
        assert cut["finish_reason"] == "abort" and len(cut["tokens"]["response"]) < 400
        full = await long_b
        assert (full["finish_reason"], len(full["tokens"]["response"])) == ("length", 300)

        # unloading a paused adapter refuses the requests waiting on it, naming `model`
        waiting = asyncio.ensure_future(
            client.post(
                "/v1/generate",
                json={"model": "paused", "tokens": [PROMPT], "max_new_tokens": 2},
                headers=bearer(TRAINER_A),
            )
        )
        await until(lambda: registry.adapter_state("paused").waiting == 1)
        await a.unload_adapter(name="paused")
        refused = await waiting
        assert refused.status_code == 422 and refused.json()["error"]["param"] == "model"
        assert "unloaded" in refused.json()["error"]["message"]
        await b.unload_adapter(name="serving")


async def test_keep_returns_at_once_and_lets_the_request_inside_finish_on_its_version(
    client, trained
):
    registry = client.app.state.registry
    async with api(client, TRAINER_A) as a:
        await a.push_adapter(name="kept", payload=adapter_file(trained["a"]))
        inside = asyncio.ensure_future(generate(client, "kept", 300, TRAINER_A))
        await until(lambda: registry.adapter_state("kept").in_flight == 1)
        kept = await a.pause_adapter(name="kept", mode="keep")
        assert (kept.paused, kept.in_flight) == ("keep", 1)
        tensors = save(get_peft_model_state_dict(trained["a-next"]))
        assert (await a.push_adapter(name="kept", payload=tensors)).version == 1
        finished = await inside
        assert (finished["finish_reason"], len(finished["tokens"]["response"])) == ("length", 300)
        assert finished["policy_versions"] == [{"version": 0, "start": 0, "end": 300}]
        mode = await client.post(
            "/v1/adapters/kept/pause", json={"mode": "wait"}, headers=bearer(TRAINER_A)
        )
        assert mode.status_code == 409 and mode.json()["error"]["param"] == "mode"
        # a request waits for the adapter's resume only limits.paused_wait_s: then a 503 to
        # retry, naming the setting, nothing started
        registry.adapter_gates["kept"].paused_wait_s = 0.3
        waited = await client.post(
            "/v1/generate",
            json={"model": "kept", "tokens": [PROMPT], "max_new_tokens": 2},
            headers=bearer(TRAINER_A),
        )
        assert waited.status_code == 503 and waited.headers["retry-after"] == "5"
        assert "adapter 'kept'" in waited.json()["error"]["message"]
        assert registry.adapter_state("kept").waiting == 0
        await a.resume_adapter(name="kept")
        assert (await generate(client, "kept", 2, TRAINER_A))["policy_versions"][0]["version"] == 1
        await a.unload_adapter(name="kept")


async def test_without_admin_keys_each_key_changes_its_own_adapters_alone(settings, trained):
    config = settings.replace(
        storage={"data_dir": settings.storage.data_dir / "tenants-no-admin"},
        auth={"api_keys": [TRAINER_A, TRAINER_B]},
    )
    async with served_app(config) as client:
        payload = adapter_file(trained["a"])
        mine = await client.put("/v1/adapters/mine", content=payload, headers=bearer(TRAINER_A))
        assert mine.status_code == 200, mine.text
        theirs = await client.delete("/v1/adapters/mine", headers=bearer(TRAINER_B))
        assert theirs.status_code == 403
        # vLLM's unload route takes any key here (no admin keys), ownership still holds
        vllm = await client.post(
            "/v1/unload_lora_adapter", json={"lora_name": "mine"}, headers=bearer(TRAINER_B)
        )
        assert vllm.status_code == 403 and vllm.json()["error"]["param"] == "lora_name"
        gone = await client.delete("/v1/adapters/mine", headers=bearer(TRAINER_A))
        assert gone.status_code == 200


async def test_adapter_names_are_bounded_per_key_and_in_total(settings, trained):
    """Any key may upload adapters, so the names one key serves and all keys serve together
    are bounded (each holds its tensors in the server's memory): past a bound, a new name is
    a 429 naming the setting, before its tensors are read; a name served already takes new
    versions; unloading one makes room; an admin key is bounded by the total alone."""
    config = settings.replace(
        storage={"data_dir": settings.storage.data_dir / "tenants-bounded"},
        auth={"api_keys": [TRAINER_A, TRAINER_B], "admin_api_keys": [ADMIN]},
        models={"max_adapters": 3, "max_adapters_per_key": 2},
    )
    payload = adapter_file(trained["a"])

    async def push(name: str, key: str, body: bytes = payload) -> httpx.Response:
        return await client.put(f"/v1/adapters/{name}", content=body, headers=bearer(key))

    async with served_app(config) as client:
        for name in ("a-1", "a-2"):
            assert (await push(name, TRAINER_A)).status_code == 200
        refused = await push("a-3", TRAINER_A, b"not even read")
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert "RLSERVE_MODELS__MAX_ADAPTERS_PER_KEY" in error["message"], error
        assert error["param"] == "name" and "retry-after" in refused.headers
        assert (await push("a-2", TRAINER_A)).json()["version"] == 1  # a served name: fine
        # the other key has room of its own, until the server is full
        assert (await push("b-1", TRAINER_B)).status_code == 200
        full = await push("b-2", TRAINER_B)
        assert full.status_code == 429 and "(RLSERVE_MODELS__MAX_ADAPTERS)" in full.text
        assert (await push("admin-1", ADMIN)).status_code == 429  # admins: the total too
        # vLLM's route refuses likewise, naming its own field
        folder_route = await client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "b-2", "lora_path": "/nowhere"},
            headers=bearer(ADMIN),
        )
        assert folder_route.status_code == 429, folder_route.text
        assert folder_route.json()["error"]["param"] == "lora_name"
        assert (await client.delete("/v1/adapters/a-1", headers=bearer(ADMIN))).status_code == 200
        assert (await push("b-2", TRAINER_B)).status_code == 200  # room again
        names = {
            m["id"] for m in (await client.get("/v1/models", headers=bearer(ADMIN))).json()["data"]
        }
        assert {"a-2", "b-1", "b-2"} <= names and "a-1" not in names
