"""Routes whose bodies may be tensors (the format: `rlserve_client.tensor_wire`, which the
client and the server share): requests sent as MEDIA_TYPE
are read as the JSON body they stand for, and a response is MEDIA_TYPE when the Accept
header asks for it. JSON stays the default both ways."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel
from rlserve_client.tensor_wire import (
    MEDIA_TYPE,
    WireFormatError,
    decode_values,
    encode,
    wants_binary,
)

from app.common.disconnect import CancellableRoute
from app.common.failures import Malformed
from app.common.protocol import json_response
from app.errors import ERROR_RESPONSES

TENSOR_BODY_DOCS: dict[str, Any] = {
    "requestBody": {
        "content": {
            MEDIA_TYPE: {
                "schema": {"type": "string", "format": "binary"},
                "description": "The JSON body with its numeric arrays as tensors (the format "
                "is described in the API overview).",
            }
        }
    }
}
TENSOR_REPLY_DOCS: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {
            MEDIA_TYPE: {
                "schema": {"type": "string", "format": "binary"},
            }
        },
        "description": f"JSON, or with `Accept: {MEDIA_TYPE}` the same body with its "
        "numeric arrays as tensors.",
    }
}


class TensorBodyRoute(CancellableRoute):
    """A route that also takes its body as MEDIA_TYPE."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            if _is_tensor_body(request.headers.get("content-type")):
                raw = await request.body()
                request = _as_json(request, raw, _decode(raw))
            return await handler(request)

        return route_handler


def _decode(raw: bytes) -> Any:
    try:
        return decode_values(raw)
    except WireFormatError as error:
        raise Malformed(str(error), param="body") from error


def _is_tensor_body(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";")[0].strip().lower() == MEDIA_TYPE


def asks_binary(request: Request) -> bool:
    """Whether the request's Accept header asks for a MEDIA_TYPE reply."""
    return wants_binary(request.headers.get("accept"))


def _as_json(request: Request, raw: bytes, body: Any) -> Request:
    """The same request, as if `body` had been sent as JSON (FastAPI reads `_json`)."""
    headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
    scope = {**request.scope, "headers": [*headers, (b"content-type", b"application/json")]}
    converted = Request(scope, request.receive)
    converted._body = raw
    converted._json = body
    return converted


def reply(request: Request, body: BaseModel | dict[str, Any]) -> Response:
    """`body` as MEDIA_TYPE when the request's Accept header asks for it, else as JSON. A
    dict is a body already holding tensors (built for the binary reply)."""
    if asks_binary(request):
        tree = body if isinstance(body, dict) else body.model_dump(exclude_none=True)
        return Response(encode(tree), media_type=MEDIA_TYPE)
    if isinstance(body, dict):
        raise TypeError("a tensor body can only be sent as binary")
    return json_response(body)


def tensor_post(router: APIRouter, path: str, response_model: type, summary: str) -> Any:
    """`router.post` for a route whose body and reply may travel as tensors: the error and
    tensor docs, and nulls left out of a JSON reply."""
    return router.post(
        path,
        response_model=response_model,
        response_model_exclude_none=True,
        responses={**ERROR_RESPONSES, **TENSOR_REPLY_DOCS},
        openapi_extra=TENSOR_BODY_DOCS,
        summary=summary,
    )
