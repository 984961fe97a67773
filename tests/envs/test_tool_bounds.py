"""What one step may spend on the python tool (blocks per message, wall clock across rows),
and a tool that refuses to run without the isolation it was configured for. Fake models."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fake.backend import FakeBackend, fake_app
from tests.sandboxing import needs_isolation

pytestmark = needs_isolation


@asynccontextmanager
async def client_for(tmp: Path, **tools: Any) -> AsyncIterator[httpx.AsyncClient]:
    pair = FakeBackend("policy", lambda t: -1.0), FakeBackend("reference", lambda t: -1.0)
    async with fake_app(tmp, *pair, tools=tools) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            yield client


def blocks(*codes: str) -> dict[str, str]:
    return {"text": "".join(f"```python\n{code}\n```\n" for code in codes)}


async def tool_step(client: httpx.AsyncClient, *actions: dict[str, str]) -> list[list[str]]:
    created = await client.post("/v1/envs", json={"tools": ["python"], "batch_size": len(actions)})
    env_id = created.json()["env_id"]
    await client.post(f"/v1/envs/{env_id}/reset", json={"query": ["q"] * len(actions)})
    step = await client.post(f"/v1/envs/{env_id}/step", json={"actions": list(actions)})
    assert step.status_code == 200, step.text
    return [
        [message["content"] for message in out["observation"]["history"][2:]]
        for out in step.json()["outputs"]
    ]


async def test_blocks_past_the_cap_are_reported_not_run(tmp_path: Path) -> None:
    async with client_for(tmp_path, max_blocks=2) as client:
        (messages,) = await tool_step(client, blocks("print(1)", "print(2)", "print(3)"))
    assert messages == [
        "Code block 1 executed successfully:\n1\n",
        "Code block 2 executed successfully:\n2\n",
        "Code block 3 failed:\n[not run: a message may run at most 2 code blocks]",
    ]


async def test_the_step_budget_is_shared_by_all_rows(tmp_path: Path) -> None:
    sleep = "import time\ntime.sleep(1.0)\nprint('slept')"
    async with client_for(tmp_path, step_budget_s=1.5, max_concurrent=1) as client:
        first, second = await tool_step(client, blocks(sleep, "print('late')"), blocks(sleep))
    # One run at a time: a first block takes 1 s, the block that gets the pool next is
    # killed when the 1.5 s are spent, and nothing starts after that.
    outcomes = first + second
    assert outcomes.count("Code block 1 executed successfully:\nslept\n") == 1
    killed = [m for m in outcomes if "[killed: exceeded the" in m]
    assert len(killed) == 1
    assert float(killed[0].split("exceeded the ")[1].split(" s")[0]) < 0.6
    assert sum("failed:\n[not run: " in m for m in outcomes) == 1, outcomes


async def test_without_isolation_the_tool_refuses_unless_opted_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    async with client_for(tmp_path / "a") as client:
        refused = await client.post("/v1/envs", json={"tools": ["python"]})
        assert refused.status_code == 422
        error = refused.json()["error"]
        assert error["param"] == "tools" and "bubblewrap" in error["message"]
        assert (await client.post("/v1/envs", json={})).status_code == 201  # no tool: fine
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    async with client_for(tmp_path / "b", isolation="none") as client:
        (messages,) = await tool_step(client, blocks("print('unisolated')"))
    assert messages == ["Code block 1 executed successfully:\nunisolated\n"]
