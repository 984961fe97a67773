from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancellable
from app.common.tensor_http import TENSOR_BODY_DOCS, TENSOR_REPLY_DOCS, TensorBodyRoute, reply
from app.deps import GenerationDep
from app.errors import ERROR_RESPONSES
from app.generation.protocol import GenerateRequest, GenerateResponse

router = APIRouter(tags=["generation"], route_class=TensorBodyRoute)


@router.post(
    "/v1/generate",
    response_model=GenerateResponse,
    response_model_exclude_none=True,
    responses={**ERROR_RESPONSES, **TENSOR_REPLY_DOCS},
    openapi_extra=TENSOR_BODY_DOCS,
    summary="Generate continuations",
)
@cancellable
async def generate(
    request: GenerateRequest, service: GenerationDep, http_request: Request
) -> Response:
    """Sample `n` continuations per input. `log_probs.response` is the raw model distribution;
    `log_probs.response_processed` the distribution actually sampled from."""
    return reply(http_request, await service.generate(request))
