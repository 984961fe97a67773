"""One error shape for the whole API: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.batching import BackendCallError, QueueFullError

logger = logging.getLogger(__name__)


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


def invalid(param: str, message: str) -> APIError:
    """A 422 naming `param`."""
    return APIError(422, f"{param}: {message}", param=param)


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "Malformed request (e.g. control characters in the path)"),
        (401, "Missing or invalid API key (when RLSERVE_API_KEYS is set)"),
        (413, "Request too large"),
        (422, "Invalid request"),
        (500, "Internal error"),
        (503, "Not ready or overloaded"),
    )
}


WEIGHTS_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    400: {"model": ErrorResponse, "description": "Not a valid safetensors checkpoint"},
    403: {"model": ErrorResponse, "description": "Changing weights needs an admin key"},
    504: {"model": ErrorResponse, "description": "Reading the checkpoint timed out"},
}

PUBLIC_ERROR_RESPONSES = {k: v for k, v in ERROR_RESPONSES.items() if k != 401}
"""For the routes that never ask for a key (/ready, /metrics)."""

ENV_ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    **ERROR_RESPONSES,
    404: {"model": ErrorResponse, "description": "Unknown or expired environment"},
    409: {"model": ErrorResponse, "description": "Episode done, or not reset yet"},
    429: {"model": ErrorResponse, "description": "Too many live sessions"},
}


def error_response(exc: APIError) -> JSONResponse:
    info = ErrorInfo(message=exc.message, type=exc.type, param=exc.param, code=exc.status_code)
    body = ErrorResponse(error=info).model_dump()
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _loc_to_param(loc: tuple[int | str, ...]) -> str:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    ctx = first.get("ctx") or {}
    param = ctx.get("field") or _loc_to_param(tuple(first.get("loc", ()))) or "body"
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if first.get("type") in (
        "missing",
        "extra_forbidden",
        "json_invalid",
    ) or not message.startswith(param):
        message = f"{param}: {message}"
    return APIError(422, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Map every failure, expected or not, onto the one error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(
            APIError(
                503,
                f"server overloaded, retry later ({exc})",
                type="overloaded_error",
                headers={"Retry-After": "1"},
            )
        )

    @app.exception_handler(BackendCallError)
    async def _backend_failed(_: Request, exc: BackendCallError) -> JSONResponse:
        return error_response(APIError(500, f"model call failed: {exc}", type="backend_error"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(
            APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")
        )
