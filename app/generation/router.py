from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancel_on_disconnect
from app.common.protocol import json_response
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
async def generate(
    request: GenerateRequest, service: GenerationDep, http_request: Request
) -> Response:
    """Sample `n` continuations per input. `log_probs.response` is the raw model distribution;
    `log_probs.response_processed` the distribution actually sampled from."""
    result = await cancel_on_disconnect(http_request, service.generate(request))
    return json_response(result)
