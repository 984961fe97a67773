"""Two servers sharing one session store (SQLite file, or Redis): a session made on one steps
on the other, and when both receive the same step at once it is applied once. The loser
answers 409 and its retry with the same Idempotency-Key returns the applied step. Fake
model pair, real stores."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake.backend import FakeBackend, fake_app


@pytest.fixture
async def servers(
    store_kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[list[Any]]:
    options: dict[str, dict[str, Any]] = {}
    if store_kind == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        redis.Redis.from_url(url).flushdb()
        options["storage"] = {"session_store": url}
    async with AsyncExitStack() as stack:
        out = []
        for name in ("a", "b"):
            pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
            # the same data directory: one SQLite file (unless the store is Redis)
            app = await stack.enter_async_context(fake_app(tmp_path, *pair, **options))
            transport = httpx.ASGITransport(app=app)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url=f"http://{name}")
            )
            out.append((app, client))
        yield out


async def test_the_same_step_on_two_servers_is_applied_once(servers):
    (_, a), (app_b, b) = servers
    env_id = (await a.post("/v1/envs", json={"kind": "tokens"})).json()["env_id"]
    assert (await b.post(f"/v1/envs/{env_id}/reset", json={"tokens": [[5, 6]]})).is_success
    url, body = f"/v1/envs/{env_id}/step", {"actions": [{"tokens": [7, 8]}]}
    headers = {"Idempotency-Key": "step-1"}

    envs = app_b.state.envs
    original, entered, release = envs._step, asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await release.wait()  # b has read the session; a applies the step meanwhile
        return await original(*args, **kwargs)

    envs._step = held
    on_b = asyncio.create_task(b.post(url, json=body, headers=headers))
    await entered.wait()
    on_a = await a.post(url, json=body, headers=headers)
    release.set()
    lost = await on_b
    assert on_a.status_code == 200
    assert lost.status_code == 409 and lost.json()["error"]["param"] == "env_id"
    assert lost.headers["Retry-After"] == "0"  # nothing applied: send it again
    envs._step = original
    retried = await b.post(url, json=body, headers=headers)
    assert retried.status_code == 200 and retried.json() == on_a.json()
    state = (await a.get(f"/v1/envs/{env_id}")).json()
    assert state["rows"][0]["turns"] == 1
    observation = on_a.json()["outputs"][0]["observation"]["prompt_tokens"]
    assert observation == [5, 6, 7, 8]  # applied once


async def test_the_client_retries_a_superseded_step_with_its_key(servers):
    """The Python client sends a keyed step again after a 409 with Retry-After, and gets the
    step the other server applied."""
    from rlserve_client import AsyncClient

    (_, a), (app_b, _) = servers
    env_id = (await a.post("/v1/envs", json={"kind": "tokens"})).json()["env_id"]
    await a.post(f"/v1/envs/{env_id}/reset", json={"tokens": [[5, 6]]})
    envs = app_b.state.envs
    original, entered, release = envs._step, asyncio.Event(), asyncio.Event()
    calls = 0

    async def held(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            entered.set()
            await release.wait()
        return await original(*args, **kwargs)

    envs._step = held
    transport = httpx.ASGITransport(app=app_b)
    async with AsyncClient(base_url="http://b", transport=transport) as client:
        stepping = asyncio.create_task(client.step_env(env_id, actions=[{"tokens": [7, 8]}]))
        await entered.wait()
        state = (await a.get(f"/v1/envs/{env_id}")).json()
        record = await app_b.state.envs.sessions.store.get(env_id)
        record.updated_at += 1  # another server writes the session meanwhile
        assert await app_b.state.envs.sessions.store.replace(record)
        release.set()
        result = await stepping
    assert state["rows"][0]["turns"] == 0
    assert result.outputs[0].observation.prompt_tokens == [5, 6, 7, 8]
    assert calls == 2  # the first try lost the race and applied nothing; the retry applied it
    state = (await a.get(f"/v1/envs/{env_id}")).json()
    assert state["rows"][0]["turns"] == 1
