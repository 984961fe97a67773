from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancellable
from app.common.tensor_http import TensorBodyRoute, reply, tensor_post
from app.deps import GenerationDep
from app.generation.protocol import GenerateRequest, GenerateResponse

router = APIRouter(tags=["generation"], route_class=TensorBodyRoute)


@tensor_post(router, "/v1/generate", GenerateResponse, "Generate continuations")
@cancellable
async def generate(
    request: GenerateRequest, service: GenerationDep, http_request: Request
) -> Response:
    """Sample `n` continuations per input. `log_probs.response` is the raw model distribution;
    `log_probs.response_processed` the distribution actually sampled from."""
    return reply(http_request, await service.generate(request))
