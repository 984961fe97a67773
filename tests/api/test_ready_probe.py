"""/ready after start-up: an engine that dies or hangs turns it 503 (the probe is a real
backend call, bounded in time), and one that recovers turns it back. Fake model pair."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx

from tests.fake.backend import FakeBackend, fake_app


class Breakable(FakeBackend):
    def __init__(self, name: str) -> None:
        super().__init__(name, lambda t: -0.5)
        self.state = "ok"  # ok | dead | hung
        self.probes = 0

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        self.probes += 1
        if self.state == "dead":
            raise RuntimeError("engine core process exited")
        if self.state == "hung":
            await asyncio.sleep(3600)
        return await super().score(sequences)


async def test_ready_follows_the_engine_after_start_up(tmp_path: Path) -> None:
    policy, reference = Breakable("policy"), Breakable("reference")
    async with fake_app(
        tmp_path, policy, reference, probe={"interval_s": 0, "timeout_s": 0.2}
    ) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            assert (await c.get("/ready")).status_code == 200
            assert policy.probes == 1 and reference.probes == 1  # a real call each
            policy.state = "dead"
            dead = await c.get("/ready")
            assert dead.status_code == 503
            assert "policy engine failed a probe" in dead.json()["error"]["message"]
            # loaded, serving as vLLM's /health says; the probe is /ready's
            assert (await c.get("/health")).status_code == 200
            policy.state, reference.state = "ok", "hung"
            hung = await c.get("/ready")
            assert hung.status_code == 503
            assert "reference engine did not answer" in hung.json()["error"]["message"]
            reference.state = "ok"
            assert (await c.get("/ready")).status_code == 200


async def test_probes_are_shared_and_spaced(tmp_path: Path) -> None:
    """Many /ready calls within the interval cost one probe; a request answered meanwhile
    counts as one."""
    policy, reference = Breakable("policy"), Breakable("reference")
    async with fake_app(tmp_path, policy, reference, probe={"interval_s": 60}) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as c:
            scored = await c.post("/v1/logprobs", json={"tokens": [[5, 6, 7]]})
            assert scored.status_code == 200
            calls = policy.probes
            answers = await asyncio.gather(*(c.get("/ready") for _ in range(20)))
            assert all(a.status_code == 200 for a in answers)
            assert policy.probes == calls  # the request just answered was proof enough
            assert reference.probes == 1  # probed once for all twenty


async def test_a_long_batch_in_flight_keeps_the_engine_ready(settings) -> None:  # type: ignore[no-untyped-def]
    """A generation longer than the probe's timeout: the probe's forward would wait behind
    it on the model thread and time out, but the batch's own steps show the engine alive, so
    /ready stays 200 (a replica is not restarted for being busy)."""
    from tests.conftest import served_app

    configured = settings.replace(
        models={"backend": "transformers", "load_reference": False},
        probe={"interval_s": 0.3, "timeout_s": 0.3},
        limits={"max_new_tokens": 4096},
    )
    async with served_app(configured, timeout=300) as c:
        body = {"tokens": [[1, 2, 3]] * 8, "max_tokens": 1500, "ignore_eos": True}
        long = asyncio.create_task(c.post("/v1/generate", json=body))
        await asyncio.sleep(0.5)
        answers = []
        while not long.done():
            answers.append((await c.get("/ready")).status_code)
            await asyncio.sleep(0.4)
        done = await long
        assert done.status_code == 200, done.text
        assert len(answers) >= 3, "the batch ended too soon to probe during it"
        assert set(answers) == {200}, answers
