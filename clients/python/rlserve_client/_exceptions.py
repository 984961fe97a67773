"""Errors raised by the client.

RLServeError
├── APIConnectionError          the request never got an answer
│   └── APITimeoutError
└── APIStatusError              the server answered with a 4xx/5xx (status_code, body, request_id)
    ├── BadRequestError             400
    ├── AuthenticationError         401
    ├── PermissionDeniedError       403
    ├── NotFoundError               404
    ├── ConflictError               409
    ├── RequestTooLargeError        413
    ├── UnprocessableEntityError    422
    ├── RateLimitError              429
    ├── InternalServerError         500 and other 5xx
    └── ServiceUnavailableError     503
"""

from __future__ import annotations

from typing import Any

import httpx


class RLServeError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(RLServeError):
    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.request = request


class APITimeoutError(APIConnectionError):
    pass


class APIStatusError(RLServeError):
    """The server's error body is `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, response: httpx.Response, body: Any) -> None:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        self.status_code = response.status_code
        self.body = body
        self.message = str(error.get("message") or response.reason_phrase)
        self.type = error.get("type")
        self.param = error.get("param")
        self.request_id = response.headers.get("x-request-id")
        self.response = response
        # The class says the status (`status_code` holds it): str() is what to fix.
        super().__init__(self.message)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status_code={self.status_code}, message={self.message!r})"


class BadRequestError(APIStatusError):
    pass


class AuthenticationError(APIStatusError):
    pass


class PermissionDeniedError(APIStatusError):
    pass


class NotFoundError(APIStatusError):
    pass


class ConflictError(APIStatusError):
    pass


class RequestTooLargeError(APIStatusError):
    pass


class UnprocessableEntityError(APIStatusError):
    pass


class RateLimitError(APIStatusError):
    pass


class InternalServerError(APIStatusError):
    pass


class ServiceUnavailableError(InternalServerError):
    pass


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    413: RequestTooLargeError,
    422: UnprocessableEntityError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def status_error(response: httpx.Response) -> APIStatusError:
    try:
        body: Any = response.json()
    except ValueError:
        body = response.text
    if response.status_code in _BY_STATUS:
        return _BY_STATUS[response.status_code](response, body)
    if response.status_code >= 500:
        return InternalServerError(response, body)
    return APIStatusError(response, body)
