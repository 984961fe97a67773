from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancellable
from app.common.tensor_http import TensorBodyRoute, asks_binary, reply, tensor_post
from app.deps import ScoringDep
from app.scoring.protocol import LogProbsRequest, LogProbsResponse

router = APIRouter(tags=["scoring"], route_class=TensorBodyRoute)


@tensor_post(router, "/v1/logprobs", LogProbsResponse, "Score given sequences")
@cancellable
async def logprobs(
    request: LogProbsRequest, service: ScoringDep, http_request: Request
) -> Response:
    """Log-probability of every token under the model (raw distribution, position 0 is 0.0)."""
    return reply(http_request, await service.score(request, tensors=asks_binary(http_request)))
