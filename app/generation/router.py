from fastapi import APIRouter

from app.deps import GenerationDep
from app.errors import ERROR_RESPONSES
from app.generation.protocol import GenerateRequest, GenerateResponse

router = APIRouter(tags=["generation"])


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Generate continuations",
)
async def generate(request: GenerateRequest, service: GenerationDep) -> GenerateResponse:
    """Sample `n` continuations per input. `log_probs.response` is the raw model distribution;
    `log_probs.response_processed` the distribution actually sampled from."""
    return await service.generate(request)
