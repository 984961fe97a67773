from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancel_on_disconnect
from app.common.protocol import json_response
from app.deps import ScoringDep
from app.errors import ERROR_RESPONSES
from app.scoring.protocol import LogProbsRequest, LogProbsResponse

router = APIRouter(tags=["scoring"])


@router.post(
    "/v1/logprobs",
    response_model=LogProbsResponse,
    response_model_exclude_none=True,
    responses=ERROR_RESPONSES,
    summary="Score given sequences",
)
async def logprobs(
    request: LogProbsRequest, service: ScoringDep, http_request: Request
) -> Response:
    """Log-probability of every token under the model (raw distribution, position 0 is 0.0)."""
    result = await cancel_on_disconnect(http_request, service.score(request))
    return json_response(result)
