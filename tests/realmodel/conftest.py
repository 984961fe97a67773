"""The real-model tier: SmolLM2-135M-Instruct (the default model, a real BPE tokenizer and a
chat template without generation tags) served in-process on each backend, beside a plain
transformers copy of the same folder. Its conversion is cached in the user's cache directory,
so it runs once per machine (about 35 s), not once per test session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config import Settings
from app.config_groups import DEFAULT_MODEL
from app.engine.loader import smollm2_dir
from tests.conftest import BACKENDS, backend_settings, served_app

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def real_settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        models={"model": DEFAULT_MODEL, "load_reference": False},
        storage={"data_dir": tmp_path_factory.mktemp("real-model-data")},
        limits={"max_new_tokens": 512},
    )


@pytest.fixture(scope="session")
def real_dir(real_settings: Settings) -> Path:
    return smollm2_dir(real_settings.models)


@pytest.fixture(scope="session")
def real_hf(real_dir: Path) -> torch.nn.Module:
    """The converted folder loaded the plain transformers way: the independent computation."""
    return AutoModelForCausalLM.from_pretrained(real_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def real_tokenizer(real_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(real_dir)


@pytest.fixture(scope="session", params=BACKENDS)
async def real_client(
    request: pytest.FixtureRequest, real_settings: Settings
) -> AsyncIterator[httpx.AsyncClient]:
    settings = backend_settings(real_settings, str(request.param))
    if settings.models.backend == "vllm":  # the model's 8,192-token context needs 0.35 GiB of cache
        settings = settings.replace(vllm={"kv_cache_memory_bytes": 512 << 20})
    async with served_app(settings, timeout=600) as c:
        yield c


async def post(client: httpx.AsyncClient, path: str, body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]
