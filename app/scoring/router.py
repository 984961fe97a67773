from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancellable
from app.common.tensor_http import (
    TENSOR_BODY_DOCS,
    TENSOR_REPLY_DOCS,
    TensorBodyRoute,
    asks_binary,
    reply,
)
from app.deps import ScoringDep
from app.errors import ERROR_RESPONSES
from app.scoring.protocol import LogProbsRequest, LogProbsResponse

router = APIRouter(tags=["scoring"], route_class=TensorBodyRoute)


@router.post(
    "/v1/logprobs",
    response_model=LogProbsResponse,
    response_model_exclude_none=True,
    responses={**ERROR_RESPONSES, **TENSOR_REPLY_DOCS},
    openapi_extra=TENSOR_BODY_DOCS,
    summary="Score given sequences",
)
@cancellable
async def logprobs(
    request: LogProbsRequest, service: ScoringDep, http_request: Request
) -> Response:
    """Log-probability of every token under the model (raw distribution, position 0 is 0.0)."""
    return reply(http_request, await service.score(request, tensors=asks_binary(http_request)))
