"""Chat environments whose work happens on the server (TorchRL `ChatEnv` semantics); the
policy module is `rlserve_client.policy.RemotePolicy`."""

from __future__ import annotations

import contextlib
from typing import Any

from rlserve_client._client import AsyncClient, Client
from rlserve_client._exceptions import NotFoundError
from rlserve_client.types import EnvState, ResetResult, StepResult


class RemoteChatEnv:
    """A server-side environment session (TorchRL `ChatEnv` semantics), deleted on `close()`
    or when the `with` block ends. `config`: the `create_env` arguments."""

    def __init__(self, client: Client, **config: Any) -> None:
        self.client = client
        self.env_id = client.create_env(**config).env_id

    def reset(self, **inputs: Any) -> ResetResult:
        """`query=[...]` (with `answer=`), `messages=`, `tokens=`, or nothing for the dataset."""
        return self.client.reset_env(self.env_id, **inputs)

    def step(self, actions: list[Any]) -> StepResult:
        return self.client.step_env(self.env_id, actions=actions)

    def state(self) -> EnvState:
        return self.client.get_env(self.env_id)

    def close(self) -> None:
        with contextlib.suppress(NotFoundError):  # already expired or deleted
            self.client.delete_env(self.env_id)

    def __enter__(self) -> RemoteChatEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRemoteChatEnv:
    """Asynchronous `RemoteChatEnv`: `async with AsyncRemoteChatEnv(client, ...) as env`."""

    def __init__(self, client: AsyncClient, **config: Any) -> None:
        self.client = client
        self.config = config
        self.env_id = ""

    async def open(self) -> AsyncRemoteChatEnv:
        self.env_id = (await self.client.create_env(**self.config)).env_id
        return self

    async def reset(self, **inputs: Any) -> ResetResult:
        return await self.client.reset_env(self.env_id, **inputs)

    async def step(self, actions: list[Any]) -> StepResult:
        return await self.client.step_env(self.env_id, actions=actions)

    async def state(self) -> EnvState:
        return await self.client.get_env(self.env_id)

    async def close(self) -> None:
        with contextlib.suppress(NotFoundError):
            await self.client.delete_env(self.env_id)

    async def __aenter__(self) -> AsyncRemoteChatEnv:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
