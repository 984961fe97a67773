"""Python client for rlserve: `Client` and `AsyncClient` over every route (typed results,
typed errors, retries), remote TorchRL pieces and episode collection."""

from rlserve_client._base import NOT_GIVEN
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
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    RLServeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from rlserve_client.advantages import group_advantages
from rlserve_client.async_collector import AsyncCollector
from rlserve_client.collect import collect
from rlserve_client.remote import AsyncRemoteChatEnv, RemoteChatEnv

TYPE_CHECKING = False
if TYPE_CHECKING:
    from rlserve_client.policy import RemotePolicy


def __getattr__(name: str) -> object:
    """`RemotePolicy` imports torch (and torchrl when present) on first use only."""
    if name == "RemotePolicy":
        from rlserve_client.policy import RemotePolicy

        return RemotePolicy
    raise AttributeError(f"module 'rlserve_client' has no attribute {name!r}")


__all__ = [
    "NOT_GIVEN",
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncCollector",
    "AsyncRemoteChatEnv",
    "AuthenticationError",
    "BadRequestError",
    "Client",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RLServeError",
    "RateLimitError",
    "RemoteChatEnv",
    "RemotePolicy",
    "RequestTooLargeError",
    "ServiceUnavailableError",
    "UnprocessableEntityError",
    "collect",
    "group_advantages",
]
