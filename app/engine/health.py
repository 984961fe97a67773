"""Readiness after start-up: does each engine still answer? (SGLang's /health_generate idea.)

A probe runs a real forward per served model, bounded in time, unless the model answered a
request within the probe interval. Concurrent /ready calls share one probe, and its verdict
is reused for the interval, so probing never adds more than one forward per interval."""

from __future__ import annotations

import asyncio
import logging
import time

from app.common.failures import NotReady
from app.engine.registry import ModelRegistry

logger = logging.getLogger(__name__)


class EngineProbe:
    def __init__(self, registry: ModelRegistry, *, interval_s: float, timeout_s: float) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._verdict: tuple[float, str | None] | None = None
        self._running: asyncio.Task[str | None] | None = None

    async def require_ready(self) -> None:
        """NotReady naming the problem, if there is one."""
        if (problem := await self.problem()) is not None:
            raise NotReady(f"not ready, {problem}")

    async def problem(self) -> str | None:
        """None when every engine answers; else why not (the registry's state first)."""
        if (reason := self.registry.not_ready_reason()) is not None:
            return reason
        if self.registry.gate.state().paused:
            # Frozen on purpose: a probe would wait for the resume. The last verdict stands.
            return self._verdict[1] if self._verdict is not None else None
        if self._verdict is not None and time.monotonic() - self._verdict[0] < self.interval_s:
            return self._verdict[1]
        if self._running is None:
            self._running = asyncio.create_task(self._probe())
            self._running.add_done_callback(lambda _: setattr(self, "_running", None))
        return await asyncio.shield(self._running)

    async def _probe(self) -> str | None:
        verdict: str | None = None
        for name, served in self.registry.models.items():
            try:
                await asyncio.wait_for(served.check(self.interval_s), self.timeout_s)
            except TimeoutError:
                verdict = f"the {name} engine did not answer a probe within {self.timeout_s:g} s"
            except Exception as exc:
                verdict = f"the {name} engine failed a probe: {type(exc).__name__}: {exc}"
            if verdict is not None:
                logger.error("readiness probe: %s", verdict)
                break
        self._verdict = (time.monotonic(), verdict)
        return verdict
