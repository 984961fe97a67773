"""`POST /v1/chat/completions` and `POST /v1/completions`: OpenAI's shapes, OpenAI's status
codes (an invalid request is a 400, as OpenAI answers it), server-sent events with `stream`."""

import logging
from collections.abc import AsyncIterator, Iterable
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import StreamingResponse

from app.common.disconnect import cancellable
from app.common.protocol import json_response
from app.deps import OwnerDep
from app.dialects.openai.answers import ChatCompletion, Completion
from app.dialects.openai.protocol import ChatCompletionRequest, CompletionRequest
from app.dialects.openai.replies import Job
from app.dialects.openai.service import OpenAIService
from app.dialects.openai.streaming import sse_event
from app.errors import (
    ERROR_RESPONSES,
    APIError,
    ErrorResponse,
    WordedRoute,
    error_body,
    error_response,
)

logger = logging.getLogger(__name__)


async def _service(request: Request) -> OpenAIService:
    service: OpenAIService = request.app.state.openai
    return service


OpenAIDep = Annotated[OpenAIService, Depends(_service)]
"""The OpenAI routes' service (built in `app.main`), for this dialect's routes and vLLM's."""


class OpenAIRoute(WordedRoute):
    """Answers an invalid request with 400 (OpenAI's status) instead of this API's 422."""

    def word(self, error: APIError) -> Response:
        return error_response(_as_400(error))


def _as_400(error: APIError) -> APIError:
    if error.status_code == 422:
        error.status_code = 400
    return error


router = APIRouter(tags=["openai"], route_class=OpenAIRoute)
RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "Invalid request (OpenAI's status for it)"},
    404: {"model": ErrorResponse, "description": "No such model, or trajectory of another key"},
    409: {"model": ErrorResponse, "description": "The trajectory has its maximum of turns"},
    200: {
        "description": "The reply, or with `stream: true` server-sent events: one chunk per "
        "`data:` line, then `data: [DONE]`",
        "content": {
            "text/event-stream": {
                "schema": {
                    "type": "object",
                    "description": "One server-sent event: `data` holds a chunk's JSON.",
                    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
                }
            }
        },
    },
}
TrajectoryHeader = Annotated[
    str | None,
    Header(
        alias="X-Trajectory-ID",
        description="Records the completion in this trajectory (as the trajectory_id field).",
        max_length=128,
        pattern=r"^[A-Za-z0-9._:-]+$",
    ),
]


IGNORED_HEADER = "X-Ignored-Fields"
"""Names the request's fields this server does not know and ignored (as vLLM ignores them,
only logging them): a misspelled `temprature` is told to the client, not only to the log."""


ANSWER_RESPONSES: dict[int | str, dict[str, Any]] = {
    **RESPONSES,
    200: {
        "headers": {
            IGNORED_HEADER: {
                "description": "The request's fields this server ignored (unknown to it), "
                "percent-encoded and comma-separated (the first 32); absent when there are "
                "none.",
                "schema": {"type": "string"},
            }
        }
    },
}


IGNORED_NAMED = 32
"""At most this many ignored fields are named (then `, ...`)."""


def _ignored_header(names: Iterable[str]) -> dict[str, str]:
    """The X-Ignored-Fields header for `names` (none: no header), each name percent-encoded
    (a header holds ASCII; `temprature` stays as it is)."""
    named = sorted(names)
    if not named:
        return {}
    shown = [quote(name, safe="") for name in named[:IGNORED_NAMED]]
    more = [f"... ({len(named) - IGNORED_NAMED} more)"] if len(named) > IGNORED_NAMED else []
    return {IGNORED_HEADER: ", ".join([*shown, *more])}


async def _answer(job: Job, service: OpenAIService) -> Response:
    ignored = _ignored_header(job.request.model_extra or {})
    if job.request.stream:
        events = await service.open_stream(job)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **ignored}
        return StreamingResponse(_sse(events), media_type="text/event-stream", headers=headers)
    response = json_response(await service.complete(job))
    response.headers.update(ignored)
    return response


async def _sse(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The events, then `[DONE]`; a failure after the stream started is an `error` event in
    OpenAI's error shape (the status line is already sent)."""
    try:
        async for event in events:
            yield event
    except Exception as exc:
        logger.warning("stream failed: %r", exc)
        yield sse_event(error_body(exc))
    yield "data: [DONE]\n\n"


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletion,
    response_model_exclude_none=True,
    responses=ANSWER_RESPONSES,
    summary="OpenAI chat completions",
)
@cancellable
async def chat_completions(
    body: ChatCompletionRequest,
    service: OpenAIDep,
    owner: OwnerDep,
    trajectory: TrajectoryHeader = None,
) -> Response:
    """OpenAI's chat completions over the served model's chat template, with rlserve's
    extensions (token ids, raw or processed log-probs, policy versions, trajectories)."""
    return await _answer(await service.chat_job(body, owner, trajectory), service)


@router.post(
    "/v1/completions",
    response_model=Completion,
    response_model_exclude_none=True,
    responses=ANSWER_RESPONSES,
    summary="OpenAI completions",
)
@cancellable
async def completions(
    body: CompletionRequest,
    service: OpenAIDep,
    owner: OwnerDep,
    trajectory: TrajectoryHeader = None,
) -> Response:
    """OpenAI's (legacy) completions of text or token prompts, with rlserve's extensions."""
    return await _answer(await service.completion_job(body, owner, trajectory), service)
