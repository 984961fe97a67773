"""`Client` and `AsyncClient`: the same keyword-only methods (defined once, in `_Methods`) over a
sync or an async transport, with connection pooling, per-call timeouts and bounded retries on
connection errors, 408, 429 and 503 (never on other 4xx)."""

from __future__ import annotations

import asyncio
import itertools
import time
from abc import ABC, abstractmethod
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Generic, TypeVar

import httpx

from rlserve_client import _routes as routes
from rlserve_client._base import DEFAULT_TIMEOUT, Call, next_delay, request_arguments, settings
from rlserve_client._exceptions import APIConnectionError, APITimeoutError, status_error

R = TypeVar("R")
Json = dict[str, Any]
Timeout = float | httpx.Timeout | None


class _Methods(ABC, Generic[R]):
    """Every route once; `R` is `dict` for `Client` and an awaitable of it for `AsyncClient`."""

    @abstractmethod
    def _send(self, call: Call, timeout: Timeout) -> R: ...

    def generate(
        self,
        *,
        messages: Any = None,
        text: Any = None,
        tokens: Any = None,
        model: str = "policy",
        timeout: Timeout = None,
        **params: Any,
    ) -> R:
        """`params`: max_new_tokens/max_tokens, n, temperature, top_p, top_k, seed, stop, ..."""
        call = routes.generate(
            messages=messages, text=text, tokens=tokens, model=model, params=params
        )
        return self._send(call, timeout)

    def logprobs(
        self,
        *,
        messages: Any = None,
        text: Any = None,
        tokens: Any = None,
        prompt_text: Any = None,
        response_text: Any = None,
        prompt_tokens: Any = None,
        response_tokens: Any = None,
        model: str = "policy",
        timeout: Timeout = None,
    ) -> R:
        split = {
            "prompt_text": prompt_text,
            "response_text": response_text,
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
        }
        call = routes.logprobs(
            messages=messages, text=text, tokens=tokens, model=model, split=split
        )
        return self._send(call, timeout)

    def kl(
        self,
        *,
        messages: Any = None,
        text: Any = None,
        tokens: Any = None,
        prompt_tokens: Any = None,
        response_tokens: Any = None,
        prompt_text: Any = None,
        response_text: Any = None,
        policy_log_probs: Any = None,
        estimator: str | None = None,
        assistant_only: bool | None = None,
        coeff: float | None = None,
        rewards: Any = None,
        reward_placement: str | None = None,
        timeout: Timeout = None,
    ) -> R:
        options = {
            "prompt_tokens": prompt_tokens,
            "response_tokens": response_tokens,
            "prompt_text": prompt_text,
            "response_text": response_text,
            "policy_log_probs": policy_log_probs,
            "estimator": estimator,
            "assistant_only": assistant_only,
            "coeff": coeff,
            "rewards": rewards,
            "reward_placement": reward_placement,
        }
        options = {k: v for k, v in options.items() if v is not None}
        return self._send(
            routes.kl(messages=messages, text=text, tokens=tokens, options=options), timeout
        )

    def models(self, *, timeout: Timeout = None) -> R:
        return self._send(routes.get("/v1/models"), timeout)

    def health(self, *, timeout: Timeout = None) -> R:
        return self._send(routes.get("/health"), timeout)

    def ready(self, *, timeout: Timeout = None) -> R:
        return self._send(routes.get("/ready"), timeout)

    def batching(self, *, timeout: Timeout = None) -> R:
        return self._send(routes.get("/v1/batching"), timeout)

    def weights_version(self, *, timeout: Timeout = None) -> R:
        return self._send(routes.get("/v1/weights/version"), timeout)

    def load_weights(self, *, path: str, model: str = "policy", timeout: Timeout = None) -> R:
        return self._send(routes.load_weights(path=path, model=model), timeout)

    def upload_weights(
        self, *, payload: bytes | Path, model: str = "policy", timeout: Timeout = None
    ) -> R:
        """`payload`: a safetensors file's bytes, or its path."""
        data = payload.read_bytes() if isinstance(payload, Path) else payload
        return self._send(routes.upload_weights(payload=data, model=model), timeout)

    def create_env(
        self,
        *,
        kind: str | None = None,
        system_prompt: str | None = None,
        batch_size: int | None = None,
        max_turns: int | None = None,
        reward: str | None = None,
        tools: list[str] | None = None,
        dataset: str | None = None,
        repeats: int | None = None,
        seed: int | None = None,
        kl: dict[str, Any] | None = None,
        hashing: bool | None = None,
        timeout: Timeout = None,
    ) -> R:
        config = {
            "kind": kind,
            "system_prompt": system_prompt,
            "batch_size": batch_size,
            "max_turns": max_turns,
            "reward": reward,
            "tools": tools,
            "dataset": dataset,
            "repeats": repeats,
            "seed": seed,
            "kl": kl,
            "hashing": hashing,
        }
        return self._send(routes.create_env(config), timeout)

    def reset_env(
        self,
        env_id: str,
        *,
        query: list[str] | None = None,
        answer: list[str | None] | None = None,
        messages: Any = None,
        tokens: Any = None,
        timeout: Timeout = None,
    ) -> R:
        body = {"query": query, "answer": answer, "messages": messages, "tokens": tokens}
        return self._send(routes.reset_env(env_id, body), timeout)

    def step_env(self, env_id: str, *, actions: list[Any], timeout: Timeout = None) -> R:
        return self._send(routes.step_env(env_id, actions), timeout)

    def get_env(self, env_id: str, *, timeout: Timeout = None) -> R:
        return self._send(routes.get(f"/v1/envs/{env_id}"), timeout)

    def list_envs(self, *, offset: int = 0, limit: int = 50, timeout: Timeout = None) -> R:
        return self._send(routes.get("/v1/envs", offset=offset, limit=limit), timeout)

    def delete_env(self, env_id: str, *, timeout: Timeout = None) -> R:
        return self._send(routes.delete_env(env_id), timeout)


def _no_answer(exc: httpx.TransportError) -> APIConnectionError:
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(str(exc) or "timed out", request=exc.request)
    return APIConnectionError(str(exc), request=exc.request)


def _result(response: httpx.Response) -> Json:
    if response.status_code >= 400:
        raise status_error(response)
    if response.status_code == 204 or not response.content:
        return {}
    result: Json = response.json()
    return result


class Client(_Methods[Json]):
    """Synchronous client. `base_url` and `api_key` default to RLSERVE_URL / RLSERVE_API_KEY."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        url, headers = settings(base_url, api_key)
        self.max_retries = max_retries
        self._http = httpx.Client(
            base_url=url, headers=headers, timeout=timeout, transport=transport
        )

    def _send(self, call: Call, timeout: Timeout) -> Json:
        for attempt in itertools.count():
            try:
                response = self._http.request(**request_arguments(call, timeout))
            except httpx.TransportError as exc:
                delay = next_delay(attempt, self.max_retries)
                if delay is None:
                    raise _no_answer(exc) from exc
            else:
                delay = next_delay(attempt, self.max_retries, response)
                if delay is None:
                    return _result(response)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Methods[Coroutine[Any, Any, Json]]):
    """Asynchronous twin of `Client`: the same methods, awaited."""

    def __init__(
        self,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float | httpx.Timeout = DEFAULT_TIMEOUT,
        max_retries: int = 2,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        url, headers = settings(base_url, api_key)
        self.max_retries = max_retries
        self._http = httpx.AsyncClient(
            base_url=url, headers=headers, timeout=timeout, transport=transport
        )

    def _send(self, call: Call, timeout: Timeout) -> Coroutine[Any, Any, Json]:
        return self._send_async(call, timeout)

    async def _send_async(self, call: Call, timeout: Timeout) -> Json:
        for attempt in itertools.count():
            try:
                response = await self._http.request(**request_arguments(call, timeout))
            except httpx.TransportError as exc:
                delay = next_delay(attempt, self.max_retries)
                if delay is None:
                    raise _no_answer(exc) from exc
            else:
                delay = next_delay(attempt, self.max_retries, response)
                if delay is None:
                    return _result(response)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
