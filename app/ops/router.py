from dataclasses import asdict

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.common.failures import NotReady
from app.deps import EnvsDep, MetricsDep, ProbeDep, RegistryDep, SettingsDep
from app.errors import ERROR_RESPONSES
from app.ops.access import Access, access
from app.ops.protocol import (
    BatcherState,
    BatchingConfigOut,
    BatchingResponse,
    HealthResponse,
    Lineage,
    ModelBatching,
    ModelCard,
    ModelsResponse,
    ReadyResponse,
)

router = APIRouter(tags=["operations"])


@router.get(
    "/health",
    response_model=HealthResponse,
    responses=ERROR_RESPONSES,
    summary="Serving (vLLM's health check)",
    openapi_extra=access(Access.PUBLIC),
)
async def health(registry: RegistryDep) -> HealthResponse:
    """200 once the models serve, as vLLM's /health (whose server answers nothing while its
    model loads): 503 while they load, and after a load failed or at shutdown, so a trainer
    that polls it as vLLM's waits for a server that serves. `/live` answers whenever the
    process runs; `/ready` also probes the engines."""
    if (reason := registry.not_ready_reason()) is not None:
        raise NotReady(reason)
    return HealthResponse(status="ok", model_status=registry.status)


@router.get(
    "/live",
    response_model=HealthResponse,
    summary="Process is up (liveness)",
    openapi_extra=access(Access.PUBLIC),
)
async def live(registry: RegistryDep) -> HealthResponse:
    """200 whenever the process answers, the models' state in `model_status` (an
    orchestrator's liveness probe: a loading server is alive)."""
    return HealthResponse(status="ok", model_status=registry.status)


@router.get(
    "/ready",
    response_model=ReadyResponse,
    responses=ERROR_RESPONSES,
    summary="Models loaded",
    openapi_extra=access(Access.PUBLIC),
)
async def ready(registry: RegistryDep, probe: ProbeDep) -> ReadyResponse:
    """Ready when the models are loaded and each engine still answers a probe (a real forward,
    at most once per RLSERVE_PROBE__INTERVAL_S)."""
    await probe.require_ready()
    gate = registry.gate.state()
    lineage = registry.gate.lineage("policy")
    return ReadyResponse(
        ready=True,
        policy_version=registry.policy_version,
        paused=gate.paused,
        pause_mode=gate.mode,
        lineage=Lineage(
            number=lineage.number, since_version=lineage.since, trainer_version=lineage.named
        ),
        digests=registry.digests.all(),
    )


@router.get(
    "/v1/models", response_model=ModelsResponse, responses=ERROR_RESPONSES, summary="Served models"
)
async def models(registry: RegistryDep) -> ModelsResponse:
    """Every served name (503 until the models are loaded: never an empty list)."""
    if (reason := registry.not_ready_reason()) is not None:
        raise NotReady(reason)
    cards = []
    for served in registry.models.values():
        fields = asdict(served.backend.info)
        fields.pop("extra")
        cards.append(
            ModelCard(
                id=served.name,
                created=int(registry.loaded_at),
                **fields,
                pad_token_id=served.preparer.pad_token_id,
                root=served.backend.info.source,
            )
        )
    # Each alias (--served-model-name) is listed too, as vLLM lists every served name.
    by_name = {card.id: card for card in cards}
    for alias, target in registry.aliases.items():
        if target in by_name:
            cards.append(by_name[target].model_copy(update={"id": alias}))
    # And each LoRA adapter, with its base as `parent`, as vLLM and SGLang list them.
    for adapter in sorted(registry.adapters.values(), key=lambda a: a.name):
        update = {"id": adapter.name, "name": adapter.name, "source": adapter.source}
        update |= {"root": adapter.source, "parent": "policy"}
        cards.append(by_name["policy"].model_copy(update=update))
    # And the reward model under each of its names ('reward', its source).
    if registry.reward is not None:
        fields = asdict(registry.reward.info)
        fields.pop("extra")
        card = ModelCard(
            id="reward",
            created=int(registry.loaded_at),
            **fields,
            pad_token_id=registry.reward.preparer.pad_token_id,
            root=registry.reward.info.source,
        )
        cards += [card.model_copy(update={"id": name}) for name in registry.reward_names()]
    return ModelsResponse(data=cards, models=cards, policy_version=registry.policy_version)


@router.get(
    "/v1/batching",
    response_model=BatchingResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Batching config and state",
)
async def batching(registry: RegistryDep, settings: SettingsDep) -> BatchingResponse:
    group = settings.batching
    models = {
        name: ModelBatching(
            score=BatcherState(**asdict(served.scoring.stats())),
            generate=BatcherState(**asdict(served.generation.stats())),
        )
        for name, served in registry.models.items()
        if served.scoring is not None and served.generation is not None
    }
    if registry.pair is not None and registry.pair.batcher is not None:
        pair_state = BatcherState(**asdict(registry.pair.batcher.stats()))
        models["policy+reference"] = ModelBatching(score=pair_state)
    config = BatchingConfigOut(
        min_batch_size=group.min_batch_size,
        max_batch_size=group.max_batch_size,
        batching_timeout_ms=round(group.timeout_s * 1000, 6),
        max_batch_tokens=group.max_batch_tokens,
        max_queue=group.max_queue,
    )
    return BatchingResponse(enabled=group.enabled, config=config, models=models)


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        **ERROR_RESPONSES,
        200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}},
    },
    summary="Prometheus metrics",
    openapi_extra=access(Access.METRICS),
)
async def metrics(metrics: MetricsDep, envs: EnvsDep) -> Response:
    """Requests by route and status, latency histograms, queue depth, batch sizes, tokens
    generated and scored, live environment sessions and the current policy version."""
    metrics.env_sessions.set(await envs.count())
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
