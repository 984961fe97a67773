"""Shared fixtures: the built-in model, an independent copy of it, and the app in-process."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config import Settings
from app.engine.loader import builtin_model_dir
from app.main import create_app


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rlserve-cache")


@pytest.fixture(scope="session")
def settings(cache_dir: Path) -> Settings:
    return Settings(
        models={"model": "builtin:tiny", "cache_dir": cache_dir, "backend": "transformers"},
        storage={"data_dir": cache_dir / "data"},
        limits={"max_items_per_request": 32, "max_new_tokens": 512},
    )


@pytest.fixture(scope="session")
def model_dir(settings: Settings) -> Path:
    return builtin_model_dir(settings.models)


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> torch.nn.Module:
    """An independent copy of the built-in model, loaded the plain transformers way."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(model_dir)


@torch.inference_mode()
def forward_log_probs(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """log_softmax of a plain forward, one unpadded sequence at a time; position 0 is 0.0."""
    x = torch.tensor([ids])
    logits = model(x).logits[0, :-1].log_softmax(-1)
    return [0.0, *logits.gather(-1, x[0, 1:, None]).squeeze(-1).tolist()]


@pytest.fixture(scope="session")
def reference_log_probs(hf_model: torch.nn.Module) -> Callable[[list[int]], list[float]]:
    return lambda ids: forward_log_probs(hf_model, ids)


async def started(app: FastAPI) -> None:
    await app.state.loading
    assert app.state.registry.status == "ready", app.state.registry.error


@contextlib.asynccontextmanager
async def served_app(settings: Settings, timeout: float = 60) -> AsyncIterator[httpx.AsyncClient]:
    """The app on `settings`, its models loaded, behind an ASGI client (the app as `.app`)."""
    app: FastAPI = create_app(settings)
    async with app.router.lifespan_context(app):
        await started(app)
        transport = httpx.ASGITransport(app=app)
        base_url = "http://t"
        async with httpx.AsyncClient(transport=transport, base_url=base_url, timeout=timeout) as c:
            c.app = app  # type: ignore[attr-defined]
            yield c


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


BACKENDS = [
    "transformers",
    pytest.param(
        "vllm",
        marks=[
            pytest.mark.vllm,
            pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here"),
        ],
    ),
]


@pytest.fixture(scope="session", params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def backend_settings(settings: Settings, backend: str) -> Settings:
    """The vLLM engines run the same built-in model with a small KV cache each, at the default
    dtype: `auto` resolves to the checkpoint's float32 for both backends. They run eagerly:
    torch.compile adds about 15 s to each engine's start on this CPU, and the suite starts
    dozens (tests/e2e/test_vllm_lifecycle.py serves vLLM's compiled default)."""
    if backend == "transformers":
        return settings.replace(models={"backend": "transformers"})
    return settings.replace(
        models={"backend": "vllm"},
        vllm={"kv_cache_memory_bytes": 256 << 20, "enforce_eager": True},
    )


@pytest.fixture(scope="session")
async def app(settings: Settings, backend_name: str) -> AsyncIterator[FastAPI]:
    """The app on each backend; vLLM in its processed log-probs mode (the weights tests run
    its default raw mode)."""
    configured = backend_settings(settings, backend_name)
    configured = configured.replace(vllm={"processed_log_probs": True})
    application = create_app(configured)
    async with application.router.lifespan_context(application):
        await started(application)
        yield application


@pytest.fixture(scope="session")
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://rlserve") as c:
        yield c


@pytest.fixture(scope="session")
async def two_model_client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A server whose reference is another built-in model (seed 1), so KL is not zero."""
    ref_dir = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    data_dir = settings.storage.data_dir / "two-models"
    models = {"ref_model": str(ref_dir)}
    async with served_app(settings.replace(models=models, storage={"data_dir": data_dir})) as c:
        yield c


@pytest.fixture(scope="session")
def ref_model(settings: Settings) -> torch.nn.Module:
    ref_dir = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    return AutoModelForCausalLM.from_pretrained(ref_dir).eval()


def assert_close(actual: list[float], expected: list[float], tol: float) -> None:
    assert len(actual) == len(expected)
    worst = max((abs(a - b) for a, b in zip(actual, expected, strict=True)), default=0.0)
    assert worst <= tol, f"max abs difference {worst} > {tol}"
