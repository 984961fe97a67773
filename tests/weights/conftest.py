"""A server of its own per backend (these tests change weights and pause serving), reachable
from trainer threads through the synchronous client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from fastapi import FastAPI
from rlserve_client import Client
from transformers import AutoModelForCausalLM

from app.config import Settings
from tests.conftest import backend_settings, served_app


class LoopTransport(httpx.BaseTransport):
    """Synchronous requests (from another thread) served by the in-process app on `loop`."""

    def __init__(self, app: FastAPI, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def send() -> httpx.Response:
            body = request.read()
            forwarded = httpx.Request(
                request.method, request.url, headers=request.headers, content=body
            )
            response = await self.inner.handle_async_request(forwarded)
            content = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=content)

        return asyncio.run_coroutine_threadsafe(send(), self.loop).result()


def loop_client(app: FastAPI, loop: asyncio.AbstractEventLoop) -> Client:
    """The synchronous client trainer code uses, from another thread, for the app answering
    on `loop` (run the trainer with asyncio.to_thread)."""
    return Client(base_url="http://rlserve", transport=LoopTransport(app, loop), max_retries=0)


@dataclass
class Served:
    app: FastAPI
    http: httpx.AsyncClient
    loop: asyncio.AbstractEventLoop

    def trainer_client(self) -> Client:
        """For trainer code, run with asyncio.to_thread (the app answers on the test loop)."""
        return loop_client(self.app, self.loop)

    async def scores(self, sequences: list[list[int]], model: str = "policy") -> list[list[float]]:
        body = await self.http.post("/v1/logprobs", json={"tokens": sequences, "model": model})
        assert body.status_code == 200, body.text
        return [o["log_probs"]["full"] for o in body.json()["outputs"]]


@pytest.fixture(scope="module")
async def served(settings: Settings, backend_name: str) -> AsyncIterator[Served]:
    config = backend_settings(settings, backend_name).replace(
        storage={"data_dir": settings.storage.data_dir / f"weights-{backend_name}"},
        limits={"max_new_tokens": 4000},
    )
    async with served_app(config, timeout=120) as c:
        app = c.app
        yield Served(app, c, asyncio.get_running_loop())


@pytest.fixture
async def own_server(
    settings: Settings, tmp_path: Path
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A server of this test's own (its weights change), and an async client of it."""
    config = settings.replace(storage={"data_dir": tmp_path / "data"})
    async with served_app(config, timeout=60) as c:
        yield c.app, c


@pytest.fixture
def trainer_model(model_dir) -> Iterator[torch.nn.Module]:  # type: ignore[no-untyped-def]
    """The trainer's copy of the policy, in float32 as served."""
    yield AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(scale)
    return model
