from fastapi import APIRouter, Request, Response

from app.common.disconnect import cancellable
from app.common.tensor_http import TensorBodyRoute, reply, tensor_post
from app.deps import KLDep
from app.kl.protocol import KLRequest, KLResponse

router = APIRouter(tags=["kl"], route_class=TensorBodyRoute)


@tensor_post(router, "/v1/kl", KLResponse, "Per-token KL between policy and reference")
@cancellable
async def kl(request: KLRequest, service: KLDep, http_request: Request) -> Response:
    """Per-token KL(policy || reference) with estimators k1/k2/k3/abs, assistant-only masks and
    optional reward shaping. Reference log-probs are always computed by the server; policy
    log-probs too, unless the client sends them."""
    return reply(http_request, await service.kl(request))
