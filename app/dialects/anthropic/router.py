"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, its
status codes and its error shape (`{"type": "error", "error": {"type", "message"}}`), its
server-sent events with `stream`. Keys come as `x-api-key` (Anthropic's SDK) or as bearer
keys, as on every route."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from app.common.disconnect import cancellable
from app.common.failures import Failure
from app.common.protocol import json_response
from app.deps import OwnerDep
from app.dialects.anthropic.protocol import (
    AnthropicError,
    AnthropicErrorDetail,
    AnthropicMessage,
    CountedTokens,
    CountTokensRequest,
    MessagesRequest,
)
from app.dialects.anthropic.service import AnthropicService, event
from app.dialects.openai.router import TrajectoryHeader, _ignored_header
from app.errors import APIError, ErrorResponse, WordedRoute, failure_error

logger = logging.getLogger(__name__)


async def _service(request: Request) -> AnthropicService:
    service: AnthropicService = request.app.state.anthropic
    return service


AnthropicDep = Annotated[AnthropicService, Depends(_service)]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_error(error: APIError) -> JSONResponse:
    """`error` in Anthropic's shape; an invalid request is 400, as Anthropic answers it."""
    status = 400 if error.status_code == 422 else error.status_code
    body = AnthropicError(
        error=AnthropicErrorDetail(type=_TYPES.get(status, "api_error"), message=error.message)
    )
    return JSONResponse(body.model_dump(), status_code=status, headers=error.headers)


class AnthropicRoute(WordedRoute):
    words_http_errors = True  # (a body that does not parse: Anthropic's shape too)

    def word(self, error: APIError) -> Response:
        return anthropic_error(error)


router = APIRouter(tags=["anthropic"], route_class=AnthropicRoute)
RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": AnthropicError, "description": text}
    for code, text in (
        (400, "Invalid request (Anthropic's status for it)"),
        (404, "No such model, or trajectory of another key"),
        (409, "The trajectory has its maximum of turns"),
        (413, "The request is too large"),
        (422, "Not sent: an invalid request is a 400, as Anthropic answers it"),
        (429, "Too many requests, or a trajectory over its key's bytes"),
        (503, "Models are loading, or serving is paused past the wait"),
    )
}
# (answered before the route, or past it, in the service's own shape)
RESPONSES[401] = {"model": ErrorResponse, "description": "Missing or invalid API key"}
RESPONSES[500] = {"model": ErrorResponse, "description": "Internal error"}
RESPONSES[200] = {
    "description": "The message, or with `stream: true` Anthropic's server-sent events "
    "(message_start, content_block_start/_delta/_stop, message_delta, message_stop)",
    "content": {
        "text/event-stream": {
            "schema": {
                "type": "object",
                "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
            }
        }
    },
}


async def _events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events; a failure after the stream started is an `error` event in Anthropic's
    error shape (the status line is already sent)."""
    try:
        async for line in events:
            yield line
    except Exception as exc:
        logger.warning("stream failed: %r", exc)
        error = failure_error(exc) if isinstance(exc, Failure) else APIError(500, "internal error")
        kind = _TYPES.get(error.status_code, "api_error")
        yield event("error", {"error": {"type": kind, "message": error.message}})


@router.post(
    "/v1/messages",
    response_model=AnthropicMessage,
    response_model_exclude_none=True,
    responses=RESPONSES,
    summary="Anthropic messages",
)
@cancellable
async def messages(
    body: MessagesRequest,
    service: AnthropicDep,
    owner: OwnerDep,
    trajectory: TrajectoryHeader = None,
) -> Response:
    """Anthropic's Messages API over the served model's chat template: content blocks, tools
    and tool use, thinking, stop sequences, streaming; every reply may be recorded in a
    trajectory (`X-Trajectory-ID`) as the OpenAI routes' are, in the same trajectory."""
    job = await service.job(body, owner, trajectory)
    ignored = _ignored_header(body.model_extra or {})
    if body.stream:
        events = await service.stream(job, body)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **ignored}
        return StreamingResponse(_events(events), media_type="text/event-stream", headers=headers)
    response = json_response(await service.message(job, body))
    response.headers.update(ignored)
    return response


@router.post(
    "/v1/messages/count_tokens",
    response_model=CountedTokens,
    responses=RESPONSES,
    summary="Anthropic token count",
)
async def count_tokens(
    body: CountTokensRequest, service: AnthropicDep, owner: OwnerDep
) -> CountedTokens:
    """The prompt's tokens as `POST /v1/messages` would template it."""
    return await service.count_tokens(body, owner)
