"""Pausing a model that runs on one worker thread (the transformers backend).

Every call on the model thread runs inside `running()`; the decode loop passes `checkpoint()`
before each forward. `freeze()` makes calls wait at their next checkpoint (or before they
start) and returns once none is between two checkpoints: the weights may then change under
them. `thaw()` lets them go on. The version and the abort flag are read by the decode loop, so
each token is labelled with the version of the forward that produced its logits."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class ModelThreadControl:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._frozen = False
        self._busy = 0
        self.version = 0
        self.aborting = threading.Event()
        self.stepped_at = 0.0
        """time.monotonic() of the last checkpoint: a call in flight that passes them is alive."""

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Around one call on the model thread: waits while frozen."""
        with self._cond:
            self._cond.wait_for(lambda: not self._frozen)
            self._busy += 1
            self.stepped_at = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def checkpoint(self) -> int:
        """Between two forwards: park while frozen. Returns the version of the weights the
        next forward runs on."""
        self.stepped_at = time.monotonic()
        with self._cond:
            if self._frozen:
                self._busy -= 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._frozen)
                self._busy += 1
            return self.version

    def freeze(self, timeout_s: float | None = None) -> bool:
        """Hold calls at their next checkpoint; True once none runs (False on timeout)."""
        with self._cond:
            self._frozen = True
            return self._cond.wait_for(lambda: self._busy == 0, timeout_s)

    def thaw(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    @property
    def frozen(self) -> bool:
        return self._frozen
