"""Python client for rlserve: `Client` and `AsyncClient` over every route, typed errors, retries."""

from rlserve_client._client import AsyncClient, Client
from rlserve_client._exceptions import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    RequestTooLargeError,
    RLServeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "RLServeError",
    "RateLimitError",
    "RequestTooLargeError",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
]
