"""Admission to one LoRA adapter's work, paused and resumed apart from the policy's and every
other adapter's, and who owns the adapter.

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

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

from app.common.failures import Conflict, invalid
from app.engine.gate import PauseMode, wait_for_resume


@dataclass(frozen=True)
class AdapterGateState:
    paused: PauseMode | None
    """The mode it is paused with; None while it serves."""
    in_flight: int
    waiting: int


class AdapterGate:
    def __init__(self, name: str, owner: str, *, paused_wait_s: float | None = None) -> None:
        """`paused_wait_s`: how long a request may wait for the adapter's resume (None: no
        limit); past it, a `Paused` refusal."""
        self.name = name
        self.paused_wait_s = paused_wait_s
        self.owner = owner
        """The owner id of the key that first served the adapter ("" without keys)."""
        self.unloaded = False
        self._open = asyncio.Event()
        self._open.set()
        self._changed = asyncio.Condition()
        self._control = asyncio.Lock()
        self._mode: PauseMode | None = None
        self._in_flight: dict[object, threading.Event | None] = {}
        """Each admitted request, with the event that stops its generation rows (None for
        scoring)."""
        self._waiting = 0

    @contextlib.asynccontextmanager
    async def admitted(self, stop: threading.Event | None = None) -> AsyncIterator[None]:
        """Hold a place for one request's work with the adapter; `stop`, set by an abort
        pause, ends its generation rows at their next token."""
        while not self._open.is_set():
            self._waiting += 1
            try:
                await wait_for_resume(self._open, self.paused_wait_s, f"adapter '{self.name}'")
            finally:
                self._waiting -= 1
        if self.unloaded:
            raise invalid(
                "model",
                f"'{self.name}' is not served: the adapter was unloaded before this request "
                "began (while it waited for the adapter's resume, or just before)",
            )
        place = object()
        self._in_flight[place] = stop
        try:
            yield
        finally:
            del self._in_flight[place]
            async with self._changed:
                self._changed.notify_all()

    def state(self) -> AdapterGateState:
        return AdapterGateState(self._mode, len(self._in_flight), self._waiting)

    async def pause(self, mode: PauseMode) -> AdapterGateState:
        """Close the gate; returns once the requests inside are finished or aborted (``wait``,
        ``abort``), or at once (``keep``)."""
        async with self._control:
            if self._mode is not None:
                if self._mode == mode:
                    return self.state()
                raise Conflict(
                    f"mode: adapter '{self.name}' is already paused with mode '{self._mode}'; "
                    "resume it first",
                    param="mode",
                )
            self._open.clear()
            self._mode = mode
            try:
                if mode == "abort":
                    for stop in self._in_flight.values():
                        if stop is not None:
                            stop.set()
                if mode != "keep":
                    async with self._changed:
                        await self._changed.wait_for(lambda: not self._in_flight)
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

    def _reopen(self) -> None:
        self._mode = None
        self._open.set()
