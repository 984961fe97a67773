"""Admission to one LoRA adapter's work, paused and resumed apart from the policy's and every
other adapter's.

A pause closes the adapter's gate (new requests naming it wait, up to a bound: then a retryable
refusal) and then handles its requests already inside:

- ``wait``: lets them finish;
- ``abort``: ends their generations at the next token (they return what they produced, with
  finish_reason "abort") and lets scoring finish;
- ``keep``: returns at once; they go on with the adapter version they started with (an
  adapter's versions live side by side, so nothing needs freezing).

Rows of the policy and of other adapters batch on meanwhile. Unloading the adapter wakes the
requests waiting on it, which are then refused."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.common.failures import invalid
from app.common.roles import Role
from app.engine.gate import Admission, PauseMode


@dataclass(frozen=True)
class AdapterGateState:
    paused: PauseMode | None
    """The mode it is paused with; None while it serves."""
    in_flight: int
    waiting: int


class AdapterGate(Admission[threading.Event | None]):
    def __init__(self, name: str, *, paused_wait_s: float | None = None) -> None:
        """`paused_wait_s`: how long a request may wait for the adapter's resume (None: no
        limit); past it, a `Paused` refusal."""
        super().__init__(f"adapter '{name}'", paused_wait_s=paused_wait_s)
        self.name = name
        self.unloaded = False

    @contextlib.asynccontextmanager
    async def admitted(self, stop: threading.Event | None = None) -> AsyncIterator[None]:
        """Hold a place for one request's work with the adapter; `stop`, set by an abort
        pause, ends its generation rows at their next token (None: scoring)."""
        async with self._entered(stop):
            if self.unloaded:
                raise invalid(
                    Role.MODEL,
                    f"'{self.name}' is not served: the adapter was unloaded before this "
                    "request began (while it waited for the adapter's resume, or just before)",
                )
            yield

    def state(self) -> AdapterGateState:
        return AdapterGateState(self._mode, len(self._inside), self._waiting)

    async def pause(self, mode: PauseMode) -> AdapterGateState:
        """Close the gate; returns once the requests inside are finished or aborted (``wait``,
        ``abort``), or at once (``keep``)."""
        async with self._control:
            if self._already(mode):
                return self.state()
            self._close(mode)
            try:
                if mode == "abort":
                    for stop in self._inside_with(lambda stop: stop is not None):
                        stop.set()  # type: ignore[union-attr]
                if mode != "keep":
                    await self._drained()
            except BaseException:
                self._reopen()
                raise
            return self.state()

    async def resume(self) -> AdapterGateState:
        async with self._control:
            self._reopen()
            return self.state()

    def close(self) -> None:
        """The adapter is unloaded: requests waiting on a pause wake and are refused."""
        self.unloaded = True
        self._reopen()
