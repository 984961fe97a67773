"""`Client` and `AsyncClient`: every route of `_routes` as a method of both (bound through
`_Route`, so each signature is written once), with connection pooling, per-call timeouts and
bounded retries on connection errors, 408, 429 and 503 (never on other 4xx). A call that
changes state is sent again only when the first try never left, or when it carries an
idempotency key the server de-duplicates (env steps), so nothing is ever applied twice."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, overload

import httpx

from rlserve_client import _routes as routes
from rlserve_client import _weight_routes as weight_routes
from rlserve_client._base import (
    DEFAULT_TIMEOUT,
    Call,
    next_delay,
    pins,
    request_arguments,
    settings,
)
from rlserve_client._exceptions import APIConnectionError, APITimeoutError, status_error
from rlserve_client.types import Result

if TYPE_CHECKING:
    from rlserve_client.weight_transfer import WeightSync

P = ParamSpec("P")
T = TypeVar("T", bound=Result)


class _Route(Generic[P, T]):
    """A route function bound as a method: `Client` returns its result, `AsyncClient` an
    awaitable of it, both with the route function's exact keyword-only signature."""

    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> _Route[P, T]: ...

    @overload
    def __get__(self, client: Client, owner: type[Any]) -> Callable[P, T]: ...

    @overload
    def __get__(
        self, client: AsyncClient, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...

    def __get__(self, client: Any, owner: type[Any]) -> Any:
        if client is None:
            return self
        build = self._build

        def method(*args: P.args, **kwargs: P.kwargs) -> Any:
            return client._send(build(*args, **kwargs))

        method.__doc__ = build.__doc__
        method.__name__ = build.__name__
        return method


class _Methods:
    generate = _Route(routes.generate)
    logprobs = _Route(routes.logprobs)
    kl = _Route(routes.kl)
    rewards = _Route(routes.rewards)
    load_reward_weights = _Route(weight_routes.load_reward_weights)
    models = _Route(routes.models)
    health = _Route(routes.health)
    live = _Route(routes.live)
    ready = _Route(routes.ready)
    batching = _Route(routes.batching)
    weights_version = _Route(weight_routes.weights_version)
    load_weights = _Route(weight_routes.load_weights)
    upload_weights = _Route(weight_routes.upload_weights)
    restore_weights = _Route(weight_routes.restore_weights)
    load_snapshot = _Route(weight_routes.load_snapshot)
    snapshots = _Route(weight_routes.snapshots)
    load_adapter = _Route(weight_routes.load_adapter)
    push_adapter = _Route(weight_routes.push_adapter)
    adapters = _Route(weight_routes.adapters)
    pause_adapter = _Route(weight_routes.pause_adapter)
    resume_adapter = _Route(weight_routes.resume_adapter)
    unload_adapter = _Route(weight_routes.unload_adapter)
    pause = _Route(weight_routes.pause)
    resume = _Route(weight_routes.resume)
    serving_state = _Route(weight_routes.serving_state)
    transfer_state = _Route(weight_routes.transfer_state)
    transfer_step = _Route(weight_routes.transfer_step)
    transfer_finish = _Route(weight_routes.transfer_finish)
    create_env = _Route(routes.create_env)
    reset_env = _Route(routes.reset_env)
    step_env = _Route(routes.step_env)
    get_env = _Route(routes.get_env)
    list_envs = _Route(routes.list_envs)
    delete_env = _Route(routes.delete_env)
    rollouts = _Route(routes.rollouts)
    trajectory = _Route(routes.trajectory)
    set_trajectory_reward = _Route(routes.set_trajectory_reward)
    delete_trajectory = _Route(routes.delete_trajectory)


def _no_answer(exc: httpx.TransportError) -> APIConnectionError:
    """The error for a request that got no answer, naming the URL it was sent to."""
    try:
        request: httpx.Request | None = exc.request
    except RuntimeError:  # (httpx: an error raised without its request)
        request = None
    where = f"{request.method} {request.url}" if request is not None else "the request"
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(f"{where}: timed out ({reason})", request=request)
    return APIConnectionError(
        f"{where}: no answer ({reason}); is rlserve running there? (the client's base_url, "
        "or RLSERVE_URL)",
        request=request,
    )


def _result(call: Call[T], response: httpx.Response) -> T:
    if response.status_code >= 400:
        raise status_error(response)
    return call.parse(response)


class Client(_Methods):
    """Synchronous client. `base_url` and `api_key` default to RLSERVE_URL / RLSERVE_API_KEY."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        url, headers = settings(base_url, api_key)
        self.base_url = url
        self.max_retries = max_retries
        self.min_policy_version: int | None = None
        """Every request asks for this policy version or a later one (`X-Min-Policy-Version`):
        a server that serves an older one answers 409 with Retry-After, and the call is sent
        again (within `max_retries`), never answered from older weights. None: any."""
        self.exact_policy_version: int | None = None
        """Every request asks for exactly this policy version (`X-Policy-Version`)."""
        self._http = httpx.Client(
            base_url=url, headers=headers, timeout=timeout, transport=transport
        )

    def _send(self, call: Call[T]) -> T:
        for attempt in itertools.count():
            try:
                pinned = pins(self.min_policy_version, self.exact_policy_version)
                response = self._http.request(**request_arguments(call, pinned=pinned))
            except httpx.TransportError as exc:
                delay = next_delay(call, attempt, self.max_retries, error=exc)
                if delay is None:
                    raise _no_answer(exc) from exc
            else:
                delay = next_delay(call, attempt, self.max_retries, response=response)
                if delay is None:
                    return _result(call, response)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def weight_transfer(self, **options: Any) -> WeightSync:
        """A collective weight-transfer group with the server (see
        `rlserve_client.weight_transfer`): `with client.weight_transfer(...) as sync:
        sync.send(model)`. Options: model, master_address (this host, as the server reaches
        it), master_port (0: any free one), transport (auto, gloo, nccl), bucket_bytes,
        streams, timeout_s."""
        from rlserve_client.weight_transfer import WeightSync

        return WeightSync(self, **options)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Methods):
    """Asynchronous twin of `Client`: the same methods, awaited."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
        max_connections: int = 100,
    ) -> None:
        url, headers = settings(base_url, api_key)
        self.base_url = url
        self.max_retries = max_retries
        self.min_policy_version: int | None = None
        """As `Client.min_policy_version`."""
        self.exact_policy_version: int | None = None
        """As `Client.exact_policy_version`."""
        limits = httpx.Limits(max_connections=max_connections)
        self._http = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=timeout, transport=transport, limits=limits
        )

    async def _send(self, call: Call[T]) -> T:
        for attempt in itertools.count():
            try:
                pinned = pins(self.min_policy_version, self.exact_policy_version)
                arguments = request_arguments(call, asynchronous=True, pinned=pinned)
                response = await self._http.request(**arguments)
            except httpx.TransportError as exc:
                delay = next_delay(call, attempt, self.max_retries, error=exc)
                if delay is None:
                    raise _no_answer(exc) from exc
            else:
                delay = next_delay(call, attempt, self.max_retries, response=response)
                if delay is None:
                    return _result(call, response)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
