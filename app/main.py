"""Application factory. Importing this module loads nothing; `create_app` wires the service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app import __version__
from app.config import Settings
from app.engine.registry import ModelRegistry
from app.envs.datasets import DatasetRegistry
from app.envs.router import router as envs_router
from app.envs.service import EnvService
from app.envs.store import SQLiteSessionStore
from app.errors import install_error_handlers
from app.generation.router import router as generation_router
from app.kl.router import router as kl_router
from app.ops.router import router as ops_router
from app.rollouts.router import router as rollouts_router
from app.scoring.router import router as scoring_router
from app.weights.router import router as weights_router

logger = logging.getLogger(__name__)


async def load_or_exit(registry: ModelRegistry) -> None:
    await registry.load()
    if registry.status == "failed" and registry.settings.exit_on_load_failure:
        logger.error("stopping: the model failed to load (%s)", registry.error)
        os.kill(os.getpid(), signal.SIGTERM)


async def reap_forever(envs: EnvService, ttl_s: float) -> None:
    """Delete idle sessions now and then (expired ones also 404 on access meanwhile)."""
    while True:
        await asyncio.sleep(min(max(ttl_s / 4, 1.0), 60.0))
        try:
            if expired := await envs.reap():
                logger.info("expired %d idle environment sessions", expired)
        except Exception:
            logger.exception("reaping environment sessions failed")


def create_app(settings: Settings | None = None, *, load_models: bool = True) -> FastAPI:
    """Build the FastAPI app. Models load in the background once the app starts, so `/health`
    answers at once and `/ready` turns true when loading is done."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        registry = ModelRegistry(settings)
        app.state.registry = registry
        store = SQLiteSessionStore(settings.data_dir / "sessions.sqlite3")
        datasets = DatasetRegistry(settings.data_dir / "datasets")
        app.state.envs = EnvService(store, registry, datasets, settings)
        loading = asyncio.create_task(load_or_exit(registry)) if load_models else None
        app.state.loading = loading
        reaper = asyncio.create_task(reap_forever(app.state.envs, settings.env_ttl_s))
        try:
            yield
        finally:
            reaper.cancel()
            if loading is not None:
                await loading
            await registry.aclose()
            await store.aclose()

    app = FastAPI(
        title="rlserve",
        version=__version__,
        summary="Generation, scoring, KL and chat environments for LLM RL post-training.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    install_error_handlers(app)
    for router in (
        generation_router,
        scoring_router,
        kl_router,
        envs_router,
        rollouts_router,
        weights_router,
        ops_router,
    ):
        app.include_router(router)
    return app
