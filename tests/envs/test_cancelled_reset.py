"""A reset whose client goes away is cancelled and changes nothing, as a step is. At the ASGI
level (as uvicorn runs it), with a fake model pair."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx

from tests.asgi import Connection
from tests.fake.backend import FakeBackend, fake_app


async def test_a_reset_whose_client_left_is_cancelled_and_changes_nothing(tmp_path: Path):
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            env_id = (await client.post("/v1/envs", json={"kind": "tokens"})).json()["env_id"]
            engine = app.state.envs.engine
            real_reset, entered, cancelled = engine.reset, asyncio.Event(), asyncio.Event()

            async def held(*args: Any, **kwargs: Any) -> Any:
                entered.set()
                try:
                    await asyncio.Event().wait()  # until cancelled
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return await real_reset(*args, **kwargs)

            engine.reset = held
            body = json.dumps({"tokens": [[5, 6]]}).encode()
            connection = Connection(body)
            path = f"/v1/envs/{env_id}/reset"
            task = asyncio.create_task(connection.post(app, path))
            await asyncio.wait_for(entered.wait(), timeout=10)
            connection.leave.set()
            await asyncio.wait_for(cancelled.wait(), timeout=10)
            await asyncio.gather(task, return_exceptions=True)
            assert connection.messages == []  # nobody to answer
            state = (await client.get(f"/v1/envs/{env_id}")).json()
            assert state["started"] is False
            engine.reset = real_reset
            again = await client.post(path, json={"tokens": [[5, 6]]})  # its lock was released
            assert again.status_code == 200, again.text
