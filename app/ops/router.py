from dataclasses import asdict

from fastapi import APIRouter

from app.deps import RegistryDep
from app.errors import ERROR_RESPONSES, APIError
from app.ops.protocol import HealthResponse, ModelCard, ModelsResponse, ReadyResponse

router = APIRouter(tags=["operations"])


@router.get("/health", response_model=HealthResponse, summary="Process is up")
async def health(registry: RegistryDep) -> HealthResponse:
    return HealthResponse(status="ok", model_status=registry.status)


@router.get(
    "/ready", response_model=ReadyResponse, responses=ERROR_RESPONSES, summary="Models loaded"
)
async def ready(registry: RegistryDep) -> ReadyResponse:
    if registry.status != "ready":
        detail = f": {registry.error}" if registry.error else ""
        raise APIError(
            503, f"not ready, model is {registry.status}{detail}", type="unavailable_error"
        )
    return ReadyResponse(ready=True, policy_version=registry.policy_version)


@router.get(
    "/v1/models", response_model=ModelsResponse, responses=ERROR_RESPONSES, summary="Served models"
)
async def models(registry: RegistryDep) -> ModelsResponse:
    cards = []
    for served in registry.models.values():
        fields = asdict(served.backend.info)
        fields.pop("extra")
        cards.append(ModelCard(**fields))
    return ModelsResponse(models=cards, policy_version=registry.policy_version)
