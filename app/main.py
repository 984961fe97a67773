"""Application factory. Importing this module loads nothing; `create_app` wires the service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from rlserve_client import tensor_wire

from app import __version__
from app.adapters.router import router as adapters_router
from app.config import Settings
from app.config_groups import HttpSettings, StorageSettings
from app.datasets.bundled import BundledDatasets
from app.datasets.router import router as datasets_router
from app.datasets.service import DatasetService
from app.datasets.store import DatasetStore, SQLiteDatasetStore
from app.deploy.replicated import ReplicatedWeights
from app.deploy.replicated_adapters import Replicas
from app.dialects.anthropic.router import router as anthropic_router
from app.dialects.anthropic.service import AnthropicService
from app.dialects.areal import router as areal_router
from app.dialects.openai.router import router as openai_router
from app.dialects.openai.service import OpenAIService
from app.dialects.openrlhf import router as openrlhf_router
from app.dialects.refusals import router as refused_router
from app.dialects.sglang.embeddings import router as sglang_embeddings_router
from app.dialects.sglang.gateway import router as sglang_gateway_router
from app.dialects.sglang.router import router as sglang_router
from app.dialects.slime import router as slime_router
from app.dialects.tokenize import router as tokenize_router
from app.dialects.vllm.openai_router import render_router as vllm_render_router
from app.dialects.vllm.pooling import router as vllm_pooling_router
from app.dialects.vllm.router import router as vllm_router
from app.engine.health import EngineProbe
from app.engine.registry import ModelRegistry
from app.envs.build import build_env_service, build_sandbox
from app.envs.router import router as envs_router
from app.envs.service import EnvService
from app.envs.store import SessionStore, SQLiteSessionStore
from app.errors import install_error_handlers
from app.generation.router import router as generation_router
from app.generation.service import GenerationService
from app.kl.router import router as kl_router
from app.kl.service import KLService
from app.ops.access import Access, policy_of
from app.ops.auth import AuthMiddleware
from app.ops.context import RequestContextMiddleware
from app.ops.limits import BodyLimitMiddleware
from app.ops.metrics import Metrics
from app.ops.router import router as ops_router
from app.ops.versions import VersionPinMiddleware
from app.rewards.judges import Judges
from app.rewards.router import router as rewards_router
from app.rewards.service import RewardService
from app.rollouts.router import router as rollouts_router
from app.rollouts.service import RolloutService
from app.scoring.router import router as scoring_router
from app.scoring.service import ScoringService
from app.trajectories.router import router as trajectories_router
from app.trajectories.service import TrajectoryService
from app.trajectories.store import SQLiteTrajectoryStore, TrajectoryStore
from app.updates.driven import DrivenUpdates
from app.updates.local import LocalWeights
from app.updates.router import router as weights_router
from app.updates.router import serving_router, transfer_router

logger = logging.getLogger(__name__)


async def load_or_exit(
    registry: ModelRegistry, exit_on_failure: bool, http: HttpSettings | None = None
) -> None:
    """Load the models; say where to reach the server (`http`) once they serve."""
    await registry.load()
    if registry.status == "failed" and exit_on_failure:
        logger.error("stopping: the model failed to load (%s)", registry.error)
        os.kill(os.getpid(), signal.SIGTERM)
    elif registry.status == "ready" and http is not None:
        logger.info("ready: %s", ready_hint(http))


def ready_hint(http: HttpSettings) -> str:
    """The server's address and one request to try on it."""
    host = "127.0.0.1" if http.host in ("0.0.0.0", "::", "") else http.host
    url = f"http://{f'[{host}]' if ':' in host else host}:{http.port}"
    body = '{"messages": [[{"role": "user", "content": "Hello!"}]], "max_tokens": 16}'
    return (
        f"serving on {url} (docs: {url}/docs). Try:\n"
        f"  curl -s {url}/v1/generate -H 'content-type: application/json' -d '{body}'"
    )


async def reap_forever(envs: EnvService, trajectories: TrajectoryService, ttl_s: float) -> None:
    """Delete idle sessions and trajectories now and then (expired sessions also 404 on
    access meanwhile)."""
    while True:
        await asyncio.sleep(min(max(ttl_s / 4, 1.0), 60.0))
        try:
            if expired := await envs.reap():
                logger.info("expired %d idle environment sessions", expired)
            if expired := await trajectories.reap():
                logger.info("expired %d idle trajectories", expired)
        except Exception:
            logger.exception("reaping sessions or trajectories failed")


def open_stores(settings: StorageSettings) -> tuple[SessionStore, TrajectoryStore]:
    """Sessions and trajectories: in Redis when RLSERVE_STORAGE__SESSION_STORE names one
    (servers that share it share them), else in SQLite in the data directory."""
    if settings.session_store is not None:
        from app.envs.redis_store import RedisSessionStore
        from app.trajectories.redis_store import RedisTrajectoryStore

        url = settings.session_store
        return RedisSessionStore(url), RedisTrajectoryStore(url)
    path = settings.data_dir / "sessions.sqlite3"
    return SQLiteSessionStore(path), SQLiteTrajectoryStore(path)


def open_dataset_store(settings: StorageSettings) -> DatasetStore:
    """Uploaded datasets live beside the sessions (the same Redis, or the same SQLite file)."""
    if settings.session_store is not None:
        from app.datasets.store import RedisDatasetStore

        return RedisDatasetStore(settings.session_store)
    return SQLiteDatasetStore(settings.data_dir / "sessions.sqlite3")


def build_services(
    app: FastAPI,
    registry: ModelRegistry,
    generation: GenerationService,
    envs: EnvService,
    trajectories: TrajectoryService,
    replicas: Replicas | None = None,
) -> None:
    """The services, built once per app on `app.state`: routes reach them through `app.deps`
    and convert wire models to their typed domain calls."""
    settings: Settings = app.state.settings
    app.state.envs = envs
    limits = settings.limits
    app.state.generation = generation
    app.state.scoring = ScoringService(registry, limits)
    app.state.kl = KLService(registry, limits)
    app.state.rollouts = RolloutService(
        envs, generation, max_rollout_turns=limits.max_rollout_turns
    )
    app.state.trajectories = trajectories
    app.state.openai = OpenAIService(
        registry,
        generation,
        trajectories,
        limits,
        settings.models.reasoning_parser,
        routed_experts=settings.models.return_routed_experts,
        tokens_as_ids=settings.models.return_tokens_as_token_ids,
    )
    app.state.anthropic = AnthropicService(app.state.openai)
    app.state.weights = LocalWeights(registry, settings.weights, settings.storage.data_dir)
    if replicas is not None:  # one of several replicas: updates reach them all
        wait_s = settings.weights.io_timeout_s
        app.state.weights = ReplicatedWeights(app.state.weights, replicas, wait_s)
    app.state.driven_updates = DrivenUpdates(registry, app.state.weights)
    app.state.rewards = RewardService(registry, limits, app.state.weights)


def create_app(
    settings: Settings | None = None,
    *,
    load_models: bool = True,
    replicas: Replicas | None = None,
) -> FastAPI:
    """Build the FastAPI app. Models load in the background once the app starts, so `/health`
    answers at once and `/ready` turns true when loading is done."""
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        data_dir = settings.storage.data_dir
        registry = ModelRegistry(
            settings.models,
            settings.vllm,
            batching=settings.batching.config(),
            state_dir=data_dir / "vllm-weights",
            invariant=settings.batching.invariant,
            paused_wait_s=settings.limits.paused_wait_s,
            version_wait_s=settings.limits.version_wait_s,
        )
        app.state.registry = registry
        app.state.probe = EngineProbe(
            registry, interval_s=settings.probe.interval_s, timeout_s=settings.probe.timeout_s
        )
        metrics.watch(registry)
        store, recorded = open_stores(settings.storage)
        trajectories = TrajectoryService(recorded, registry, settings.trajectories)
        dataset_store = open_dataset_store(settings.storage)
        bundled = BundledDatasets(data_dir / "datasets")
        datasets = DatasetService(dataset_store, bundled, settings.datasets, data_dir)
        app.state.datasets = datasets
        sandbox = build_sandbox(settings.tools)
        generation = GenerationService(registry, settings.limits)
        judges = Judges(registry, generation, settings.rewards.judges)
        envs = build_env_service(
            store, sandbox, registry, datasets, settings.envs, settings.tools, judges
        )
        build_services(app, registry, generation, envs, trajectories, replicas)
        await asyncio.to_thread(sandbox.probe)
        await app.state.weights.open()
        loading = None
        if replicas is not None and load_models:
            # A replica of several takes traffic only once it serves what the others serve.
            await load_or_exit(registry, exit_on_failure)
            if registry.status == "ready":
                await app.state.weights.catch_up()
        elif load_models:
            loading = asyncio.create_task(load_or_exit(registry, exit_on_failure, settings.http))
        app.state.loading = loading
        ttl = min(settings.envs.ttl_s, settings.trajectories.ttl_s)
        reaper = asyncio.create_task(reap_forever(envs, trajectories, ttl))
        try:
            yield
        finally:
            reaper.cancel()
            if loading is not None:
                await loading
            await app.state.weights.aclose()
            await registry.aclose()
            await store.aclose()
            await recorded.aclose()
            await dataset_store.aclose()

    app = FastAPI(
        title="rlserve",
        version=__version__,
        summary="Generation, scoring, KL and chat environments for LLM RL post-training.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    exit_on_failure = settings.models.exit_on_load_failure
    metrics = Metrics(replica=settings.storage.replica_id)
    app.state.metrics = metrics
    install_error_handlers(app)
    routers = (
        generation_router,
        scoring_router,
        kl_router,
        rewards_router,
        envs_router,
        datasets_router,
        rollouts_router,
        weights_router,
        adapters_router,
        transfer_router,
        serving_router,
        openai_router,
        anthropic_router,
        trajectories_router,
        ops_router,
        vllm_router,
        vllm_render_router,
        vllm_pooling_router,
        sglang_router,
        sglang_gateway_router,
        sglang_embeddings_router,
        openrlhf_router,
        slime_router,
        tokenize_router,
        areal_router,
        refused_router,
    )
    routes = [route for router in routers for route in router.routes]
    app.state.routes = routes  # flat, with each route's declared policy (app.ops.access)
    # Added innermost first: the request context wraps auth, which wraps the body limit,
    # which wraps the version pins.
    app.add_middleware(VersionPinMiddleware)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=settings.http.max_body_bytes)
    app.add_middleware(AuthMiddleware, settings=settings.auth)
    app.add_middleware(
        RequestContextMiddleware,
        metrics=metrics,
        routes=routes,
        replica=settings.storage.replica_id,
    )
    if settings.http.cors_origins:  # added last: it runs first, answering preflights itself
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.http.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID"],
        )
    # The routes themselves, not `include_router`: since FastAPI 0.137 an included router
    # stays a node that every request resolves through (matching its routes again), and
    # these routers add nothing at inclusion (no prefix, dependencies or options). A route
    # built on its own router does not consult `app.dependency_overrides`; tests swap the
    # services on `app.state` instead.
    app.router.routes.extend(routes)
    app.openapi = lambda: openapi_with_auth(app)  # type: ignore[method-assign]
    return app


def openapi_with_auth(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema plus the Bearer scheme, required on each operation as its route's
    declared policy says (/metrics is documented as public, its default)."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=f"## Tensor bodies ({tensor_wire.MEDIA_TYPE})\n\n{tensor_wire.__doc__}",
            routes=app.routes,
        )
        schema.setdefault("components", {})["securitySchemes"] = {
            "bearerAuth": {
                "type": "http",
                "scheme": "bearer",
                "description": "An RLSERVE_AUTH__API_KEYS key (weight routes: "
                "RLSERVE_AUTH__ADMIN_API_KEYS "
                "when set). Not required when the server has no keys configured.",
            }
        }
        schema["security"] = [{"bearerAuth": []}]
        for route in app.state.routes:
            level = policy_of(route).access
            for method in getattr(route, "methods", ()):
                # (path_format: the path as the spec writes it, `{name}` for `{name:path}`)
                path = getattr(route, "path_format", getattr(route, "path", ""))
                operation = schema["paths"].get(path, {}).get(method.lower())
                if operation is not None:
                    declare_access(operation, level)
        app.openapi_schema = _exact_bounds(schema)
    return app.openapi_schema


def _exact_bounds(node: Any) -> Any:
    """FastAPI's schema models hold numeric bounds as floats: a bound past 2**53 (a seed's)
    becomes an integer again, the value pydantic checks, so validators that compare integers
    agree with the server at the edge."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _BOUNDS and isinstance(value, float) and value.is_integer():
                if abs(value) >= 2**53:
                    node[key] = int(value)
            else:
                _exact_bounds(value)
    elif isinstance(node, list):
        for item in node:
            _exact_bounds(item)
    return node


_BOUNDS = ("maximum", "minimum", "exclusiveMaximum", "exclusiveMinimum")


def declare_access(operation: dict[str, Any], level: Access) -> None:
    """An operation's security and auth statuses, as its route's declared policy says."""
    responses = operation.setdefault("responses", {})
    if level in (Access.PUBLIC, Access.METRICS):
        operation["security"] = []
    if level is Access.PUBLIC:
        responses.pop("401", None)
    refusal = {
        Access.ADMIN: "Needs an admin key (when RLSERVE_AUTH__ADMIN_API_KEYS is set)",
        Access.OWNER: "Another key's: only its owner's key or an admin key may change it",
    }.get(level)
    if refusal is not None:
        responses["403"] = {
            "description": refusal,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
            },
        }
