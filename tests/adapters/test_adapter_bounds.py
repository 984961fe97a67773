"""How much an adapter upload may cost the server: a push the key may not make (another key's
adapter, a name past the key's quota) is refused before its body is read; an adapter's bytes
and rank are bounded by settings that the refusals name (a declared size before the body, a
streamed one as soon as it outgrows the bound); and what an adapter held is freed when it is
unloaded (nothing stays mapped to the deleted upload, no tensor outlives it)."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from rlserve_client.lora import adapter_file

from app.config import Settings
from tests.adapters.models import peft_model
from tests.conftest import served_app

OWNER, OTHER, ADMIN = "owner-key", "other-key", "admin-key"
MAX_BYTES = 256 << 10
CHUNK = 1 << 20


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        storage={"data_dir": settings.storage.data_dir / "adapter-bounds"},
        auth={"api_keys": [OWNER, OTHER], "admin_api_keys": [ADMIN]},
        models={"max_adapters_per_key": 1, "max_adapter_bytes": MAX_BYTES, "max_adapter_rank": 16},
    )
    async with served_app(config) as c:
        yield c


class Body:
    """A chunked request body of `chunks` chunks of 1 MiB, counting what the server read."""

    def __init__(self, chunks: int) -> None:
        self.chunks = chunks
        self.read = 0

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for _ in range(self.chunks):
            self.read += CHUNK
            yield b"\0" * CHUNK


def small_adapter(model_dir: Path, rank: int = 4) -> bytes:
    return adapter_file(peft_model(model_dir, 1, r=rank, lora_alpha=8, target_modules=["q_proj"]))


async def test_a_push_the_key_may_not_make_is_refused_before_its_body_is_read(
    client: httpx.AsyncClient, model_dir: Path
) -> None:
    served = await client.put(
        "/v1/adapters/owned", content=small_adapter(model_dir), headers=bearer(OWNER)
    )
    assert served.status_code == 200, served.text
    try:
        cases = [
            ("/v1/adapters/owned", OTHER, 403, "another API key"),  # not its adapter
            ("/v1/adapters/second", OWNER, 429, "models.max_adapters_per_key"),  # its quota
        ]
        for path, key, status, said in cases:
            body = Body(chunks=64)  # 64 MiB, over every bound: none of it may be read
            start = time.perf_counter()
            refused = await client.put(path, content=body, headers=bearer(key))
            took = time.perf_counter() - start
            assert refused.status_code == status and said in refused.json()["error"]["message"]
            assert body.read <= CHUNK, (path, body.read)  # what the transport sent at once
            assert took < 5, took
        assert not list(client.app.state.weights.files.uploads.glob("*"))
    finally:
        await client.delete("/v1/adapters/owned", headers=bearer(OWNER))


async def test_an_adapter_over_the_byte_bound_is_413_naming_the_setting(
    client: httpx.AsyncClient,
) -> None:
    # declared: refused before a byte is read
    declared = await client.put(
        "/v1/adapters/big", content=b"\0" * (MAX_BYTES + 1), headers=bearer(OWNER)
    )
    assert declared.status_code == 413
    error = declared.json()["error"]
    assert error["param"] == "body" and "models.max_adapter_bytes" in error["message"]
    assert f"{MAX_BYTES + 1} bytes declared" in error["message"]
    # chunked: refused once it outgrows the bound
    body = Body(chunks=64)
    streamed = await client.put("/v1/adapters/big", content=body, headers=bearer(OWNER))
    assert streamed.status_code == 413
    assert "models.max_adapter_bytes" in streamed.json()["error"]["message"]
    assert body.read <= 2 * CHUNK, body.read
    assert "big" not in client.app.state.registry.adapters


async def test_an_adapter_over_the_rank_bound_is_413_naming_the_setting(
    client: httpx.AsyncClient, model_dir: Path
) -> None:
    wide = small_adapter(model_dir, rank=32)
    assert len(wide) < MAX_BYTES  # (its bytes fit: its rank alone is refused)
    refused = await client.put("/v1/adapters/wide", content=wide, headers=bearer(OWNER))
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert "rank 32" in error["message"] and "models.max_adapter_rank" in error["message"]
    assert "wide" not in client.app.state.registry.adapters


def holders(thing: object) -> list[str]:
    """What still refers to `thing`, and what refers to those (a failure's explanation)."""
    return [
        f"{type(ref).__name__} <- {[type(outer).__name__ for outer in gc.get_referrers(ref)]}"
        for ref in gc.get_referrers(thing)
    ]


def mapped_deleted_files() -> list[str]:
    """This process's memory mappings of files deleted since they were mapped."""
    return [
        line for line in Path("/proc/self/maps").read_text().splitlines() if "(deleted)" in line
    ]


async def test_an_unloaded_adapter_leaves_nothing_behind(
    client: httpx.AsyncClient, model_dir: Path
) -> None:
    """The tiny model is float32, so the upload's float32 tensors need no conversion: they
    must still be the adapter's own memory, not views of the deleted upload."""
    before = mapped_deleted_files()
    for version in range(3):  # versions kept resident (models.resident_adapter_versions)
        pushed = await client.put(
            "/v1/adapters/freed", content=small_adapter(model_dir), headers=bearer(OWNER)
        )
        assert pushed.status_code == 200 and pushed.json()["version"] == version
    assert mapped_deleted_files() == before
    registry = client.app.state.registry
    adapter = registry.adapters["freed"]
    tensors = [weakref.ref(m.a) for m in adapter.modules.values()]
    tensors += [weakref.ref(m.b) for m in adapter.modules.values()]
    served = weakref.ref(adapter)
    del adapter
    # used once, so the batchers and the hooks saw it too
    body = {"model": "freed", "tokens": [[1, 2, 3]], "max_new_tokens": 2}
    assert (await client.post("/v1/generate", json=body, headers=bearer(OWNER))).status_code == 200
    assert (await client.delete("/v1/adapters/freed", headers=bearer(OWNER))).status_code == 200
    gc.collect()
    if served() is not None:
        pytest.fail(f"the unloaded adapter is still held: {holders(served())}")
    assert all(t() is None for t in tensors)
