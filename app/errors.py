"""One error shape for the whole API: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from app.batching import BackendCallError, QueueFullError
from app.common.disconnect import CancellableRoute
from app.common.failures import (
    Conflict,
    Failure,
    Forbidden,
    InvalidInput,
    Malformed,
    NotFound,
    NotReady,
    Paused,
    PeerFailed,
    QuotaExceeded,
    Superseded,
    TimedOut,
    TooLarge,
    Unsupported,
    VersionBehind,
    VersionPassed,
)
from app.words import NATIVE_WORDS


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    """The body of every non-2xx response."""

    error: ErrorInfo


class APIError(Exception):
    """An error the service answers with; `param` names the offending request field."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.headers = headers


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str
    headers: dict[str, str] | None = None


FAILURES: dict[type[Failure], ErrorKind] = {
    InvalidInput: ErrorKind(422, "invalid_request_error"),
    Unsupported: ErrorKind(422, "unsupported_error"),
    Malformed: ErrorKind(400, "invalid_request_error"),
    NotFound: ErrorKind(404, "not_found_error"),
    Forbidden: ErrorKind(403, "permission_error"),
    Superseded: ErrorKind(409, "conflict_error", {"Retry-After": "0"}),
    VersionBehind: ErrorKind(409, "version_error", {"Retry-After": "1"}),
    VersionPassed: ErrorKind(409, "version_error"),
    Conflict: ErrorKind(409, "conflict_error"),
    TooLarge: ErrorKind(413, "request_too_large"),
    QuotaExceeded: ErrorKind(429, "rate_limit_error", {"Retry-After": "5"}),
    Paused: ErrorKind(503, "unavailable_error", {"Retry-After": "5"}),
    NotReady: ErrorKind(503, "unavailable_error"),
    TimedOut: ErrorKind(504, "timeout_error"),
    PeerFailed: ErrorKind(502, "peer_error"),
    QueueFullError: ErrorKind(503, "overloaded_error", {"Retry-After": "1"}),
    BackendCallError: ErrorKind(500, "backend_error"),
    Failure: ErrorKind(400, "invalid_request_error"),
}
"""The one table from domain failures to HTTP: status, error type, headers."""


def failure_error(exc: Failure) -> APIError:
    """The APIError for a domain failure (the nearest kind in the table along its MRO)."""
    kind = next(FAILURES[cls] for cls in type(exc).__mro__ if cls in FAILURES)
    if exc.role is not None:  # (a role no route worded: rlserve's word, else its own name)
        exc.word({exc.role: NATIVE_WORDS.get(exc.role, exc.role.value)})
    return APIError(kind.status, exc.message, type=kind.type, param=exc.param, headers=kind.headers)


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "Malformed request (e.g. control characters in the path)"),
        (401, "Missing or invalid API key (when RLSERVE_AUTH__API_KEYS is set)"),
        (404, "Unknown model name (or another thing the request names)"),
        (
            409,
            "The policy version the request pins (X-Min-Policy-Version, X-Policy-Version) is "
            "not served: retry it when Retry-After says so",
        ),
        (413, "Request too large"),
        (422, "Invalid request"),
        (500, "Internal error"),
        (503, "Not ready, overloaded, or shutting down (retry it)"),
    )
}


WEIGHTS_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "Not a valid safetensors checkpoint"},
    404: {"model": ErrorResponse, "description": "No checkpoint at the path"},
    409: {"model": ErrorResponse, "description": "The checkpoint changed while it was read"},
    502: {
        "model": ErrorResponse,
        "description": "On a deployment of several replicas: some replicas failed to apply "
        "it, the others did (the message says how many)",
    },
    504: {"model": ErrorResponse, "description": "Reading the checkpoint timed out"},
}

ADAPTER_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **WEIGHTS_ERROR_RESPONSES,
    404: {"model": ErrorResponse, "description": "No such adapter, or no folder at the path"},
    409: {"model": ErrorResponse, "description": "Already paused with another mode"},
}

REWARD_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    404: {
        "model": ErrorResponse,
        "description": "No reward model is served (start the server with --reward-model)",
    },
}

REWARD_WEIGHTS_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "Not a valid safetensors checkpoint"},
    404: {
        "model": ErrorResponse,
        "description": "No checkpoint at the path, or no reward model is served",
    },
    409: {
        "model": ErrorResponse,
        "description": "The checkpoint changed while it was read, the version is not above "
        "the current one, or a delta's base is not the served weights",
    },
    504: {"model": ErrorResponse, "description": "Reading the checkpoint took too long"},
}

PAUSE_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    409: {"model": ErrorResponse, "description": "Already paused with another mode"},
}

TRANSFER_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    409: {
        "model": ErrorResponse,
        "description": "Out of order (no group, no update), or a version not above the current",
    },
    502: {"model": ErrorResponse, "description": "The trainer's side failed or went away"},
    504: {"model": ErrorResponse, "description": "The trainer did not join or send in time"},
}

ENV_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorResponse, "description": "Unknown or expired environment"},
    409: {
        "model": ErrorResponse,
        "description": "Episode done, or not reset yet, or nothing to reset from (no dataset, "
        "no prompts given); or another server stepped the session meanwhile (Retry-After: 0, "
        "nothing applied: send it again with its Idempotency-Key)",
    },
    429: {"model": ErrorResponse, "description": "Too many live sessions"},
}

DATASET_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorResponse, "description": "Unknown dataset (or another key's)"},
    409: {"model": ErrorResponse, "description": "The name is taken, or names a bundled dataset"},
    429: {"model": ErrorResponse, "description": "Too many datasets for this key"},
}


def error_body(exc: BaseException) -> dict[str, object]:
    """The error shape of any exception (a failure's own, else an internal error), for an
    answer already under way, such as a stream."""
    if isinstance(exc, Failure):
        error = failure_error(exc)
        info = ErrorInfo(
            message=error.message, type=error.type, param=error.param, code=error.status_code
        )
    else:
        info = ErrorInfo(message="internal error", type="internal_error", code=500)
    return ErrorResponse(error=info).model_dump()


def error_response(exc: APIError) -> JSONResponse:
    info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.status_code)
    body = ErrorResponse(error=info).model_dump()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


LOCATIONS = ("body", "query", "path", "header", "cookie")
"""The first part of a request validation error's location: where the value was."""


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    """A field path from pydantic's location, without the union members it tried
    ('function-after[...]', 'list[...]': no field is named with brackets)."""
    if loc and loc[0] in LOCATIONS:  # where the value was, not a field (a field may be `path`)
        loc = loc[1:]
    parts = [p for p in loc if not (isinstance(p, str) and "[" in p)]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _untagged(loc: tuple[int | str, ...], body: object) -> tuple[int | str, ...]:
    """`loc` without the tags pydantic names a tagged union's member by (a value of the body
    there, such as `/collective_rpc`'s method name, not a field)."""
    kept: list[int | str] = list(loc[:1]) if loc and loc[0] in LOCATIONS else []
    node = body
    for part in loc[len(kept) :]:
        tags = [v for v in node.values() if isinstance(v, str)] if isinstance(node, dict) else []
        if isinstance(part, str) and isinstance(node, dict) and part not in node and part in tags:
            continue
        kept.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(kept)


def validation_error(exc: RequestValidationError, request: Request | None = None) -> APIError:
    """The first error, said as what to fix: where malformed JSON breaks, a body that is not
    JSON (no content type), the fields a request takes for an unknown one."""
    first = exc.errors()[0]
    kind = first.get("type")
    loc = _untagged(tuple(first.get("loc", ())), exc.body)
    ctx = first.get("ctx") or {}
    if kind == "json_invalid":
        return APIError(422, _json_error(exc.body, loc, str(ctx.get("error", ""))))
    content_type = request.headers.get("content-type", "") if request is not None else ""
    if loc == ("body",) and kind in BODY_NOT_AN_OBJECT and "json" not in content_type:
        got = f"'{content_type}'" if content_type else "none"
        message = f"the body must be JSON sent with content-type: application/json (got {got})"
        return APIError(422, message)
    param = ctx.get("field") or _loc_to_param(loc) or "body"
    if kind in ("union_tag_invalid", "union_tag_not_found"):  # the tag's own field
        tag = str(ctx.get("discriminator", "")).strip("'")
        param = tag if param == "body" else f"{param}.{tag}"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if kind == "list_type" and isinstance(first.get("input"), dict) and _is_conversation(param):
        message = (
            "messages holds conversations, each a list of messages: "
            '{"messages": [[{"role": "user", "content": "..."}]]}'
        )
    if kind == "missing" and loc == ("body",):
        takes = ", ".join(_body_fields(request)) if request is not None else ""
        return APIError(
            422,
            "body: the request has no body; send a JSON object"
            + (f" of this route's fields ({takes})" if takes else ""),
            param="body",
        )
    if kind == "extra_forbidden" and request is not None and len(loc) == 2:
        fields = _body_fields(request)
        near = difflib.get_close_matches(str(loc[-1]), fields, n=1, cutoff=0.6)
        hint = f"did you mean '{near[0]}'? " if near else ""
        message = f"not a field of this request ({hint}it takes {', '.join(fields)})"
    if kind in ("missing", "extra_forbidden") or not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(422, message, param=param)


BODY_NOT_AN_OBJECT = ("model_attributes_type", "dict_type", "model_type")


def _json_error(body: object, loc: tuple[int | str, ...], reason: str) -> str:
    """Where malformed JSON breaks, as a line and column of the body."""
    position = loc[-1] if loc and isinstance(loc[-1], int) else None
    if not isinstance(body, str) or position is None:
        return f"the body is not valid JSON: {reason}".rstrip(": ")
    line = body.count("\n", 0, position) + 1
    column = position - (body.rfind("\n", 0, position) + 1) + 1
    return f"the body is not valid JSON: {reason} at line {line}, column {column}"


def _is_conversation(param: str) -> bool:
    """`messages[i]` of a route whose `messages` is a list of conversations."""
    head, _, rest = param.partition("[")
    return head == "messages" and rest.endswith("]") and rest[:-1].isdigit()


def _body_fields(request: Request) -> list[str]:
    """The top-level fields of the route's body model, by the names the wire uses."""
    route = request.scope.get("route")
    field = getattr(route, "body_field", None)
    model = field.field_info.annotation if field is not None else None
    fields = getattr(model, "model_fields", None)
    if not isinstance(fields, dict):
        return []
    return [info.alias or name for name, info in fields.items()]


def _allowed_methods(request: Request) -> str:
    """The methods of every route whose path matches the request's (`app.state.routes`: the
    flat list of the app's routes)."""
    methods: set[str] = set()
    for route in request.app.state.routes:
        match, _ = route.matches({**request.scope, "method": "*"})
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _no_route(request: Request) -> str:
    """A 404 for a path no route has, naming the nearest routes (a typo's likely target)."""
    routes: dict[str, set[str]] = {}
    for route in request.app.state.routes:
        path = getattr(route, "path", None)
        if path and getattr(route, "include_in_schema", True):
            routes.setdefault(path, set()).update(getattr(route, "methods", None) or ())
    path = request.url.path
    near = difflib.get_close_matches(path, list(routes), n=3, cutoff=0.75)
    named = ", ".join(
        f"{'/'.join(sorted(routes[p] - {'HEAD', 'OPTIONS'}))} {p}" for p in near if routes[p]
    )
    hint = f"; the nearest: {named}" if named else ""
    return f"no route {request.method} {path}{hint} (GET /docs lists every route)"


def install_error_handlers(app: FastAPI) -> None:
    """Map every expected failure onto the one error body (an unexpected one is answered by
    the request-context middleware, so its 500 carries the request id too)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc, request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        headers = dict(exc.headers or {})
        message = str(exc.detail)
        if exc.status_code == 405:  # RFC 9110: every method the path has, not the first route's
            headers["Allow"] = allowed = _allowed_methods(request)
            message = f"{request.method} is not a method of {request.url.path}; it takes {allowed}"
        elif exc.status_code == 404 and message == "Not Found":  # the router's: no route
            message = _no_route(request)
        error = APIError(exc.status_code, message, type=kind, headers=headers or None)
        return error_response(error)

    async def _failure(_: Request, exc: Exception) -> JSONResponse:
        return error_response(failure_error(cast(Failure, exc)))

    for failure in FAILURES:
        app.add_exception_handler(failure, _failure)


class WordedRoute(CancellableRoute):
    """A dialect's route: a request it refuses (a body that does not validate, a domain
    failure; with `words_http_errors`, also a body that does not parse) is answered by `word`
    in that dialect's shape and status, not the service's."""

    words_http_errors = False

    def word(self, error: APIError) -> Response:
        raise NotImplementedError

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return self.word(validation_error(exc, request))
            except Failure as exc:
                return self.word(failure_error(exc))
            except StarletteHTTPException as exc:
                if not self.words_http_errors:
                    raise
                return self.word(APIError(exc.status_code, str(exc.detail)))

        return handle
