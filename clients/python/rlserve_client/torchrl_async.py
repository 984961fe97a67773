"""`AsyncLLMCollector`: TorchRL's `LLMCollector`, collecting in the background while the
trainer trains, with a staleness bound.

    policy = RemotePolicy(client, versions_key="token_versions", generate_kwargs=...)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=32,
                             weight_updater=RLServeWeightUpdater(client, model=model))
    with AsyncLLMCollector(collector, client, max_staleness=1) as ahead:
        for data in ahead:                  # what iterating `collector` yields
            ...train...
            ahead.update_policy_weights_()  # the collector's own call

The rule is `AsyncCollector`'s (the plain client's): batch j is collected once the trainer has
asked for batch j - `max_staleness` (0: synchronous, 1: one-step-off), and a batch whose
oldest token (read at the policy's `versions_key`) is more than `max_staleness` versions
behind the server when handed over is set aside and replaced by the next one collected
(counted in `stats.regenerated`). A collector batch is the unit: with `dialog_turns_per_batch`
a multiple of the env's `repeats` it holds whole GRPO groups, which `MCAdvantage` needs."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import TensorDictBase

from rlserve_client._client import Client
from rlserve_client.async_collector import CollectorStats

_DONE = object()


class AsyncLLMCollector:
    """Iterates `collector` in a background thread at most `max_staleness` batches ahead of
    the trainer (see the module docstring). `versions_key`: where the `RemotePolicy` writes
    per-token versions (its `versions_key`)."""

    def __init__(
        self,
        collector: Any,
        client: Client,
        *,
        max_staleness: int = 1,
        versions_key: Any = "token_versions",
    ) -> None:
        if max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        policy_key = getattr(collector.policy, "versions_key", versions_key)
        if policy_key != versions_key:
            raise ValueError(
                f"the policy writes token versions at {policy_key!r}, not {versions_key!r}: "
                "build it with RemotePolicy(..., versions_key=...)"
            )
        self.collector = collector
        self.client = client
        tracker = getattr(collector, "policy_version_tracker", None)
        if tracker is not None and hasattr(tracker, "version"):  # count from the server's
            tracker.version = client.weights_version().policy_version
        self.max_staleness = max_staleness
        self.versions_key = versions_key
        self.stats = CollectorStats()
        self._ready: queue.Queue[Any] = queue.Queue()
        self._allowed = threading.Condition()
        self._asked = 0  # batches the trainer has asked for, the current one included
        self._collected = 0
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- the trainer's side --------------------------------------------------------------

    def __iter__(self) -> Iterator[TensorDictBase]:
        while True:
            data = self.next_batch()
            if data is None:
                return
            yield data

    def next_batch(self) -> TensorDictBase | None:
        """The next batch within the bound (None once the collector is exhausted). Asking
        tells the background thread that the trainer is done with the previous one."""
        self._start()
        started = time.perf_counter()
        self._ask()
        while True:
            data = self._take()
            if data is None:
                return None
            version = self.client.weights_version().policy_version
            oldest = self._oldest(data)
            if version - min(oldest, default=version) <= self.max_staleness:
                break
            self.stats.regenerated += data.numel()
            self._ask()  # one more batch, collected under the current weights, in its place
        self._record(data.numel(), [version - v for v in oldest], time.perf_counter() - started)
        return data

    def _ask(self) -> None:
        with self._allowed:
            self._asked += 1
            self._allowed.notify_all()

    def update_policy_weights_(self, *args: Any, **kwargs: Any) -> None:
        """The collector's weight update (its updater pushes to the server; generations in
        flight continue under the new weights when it pauses in 'keep' mode)."""
        self.collector.update_policy_weights_(*args, **kwargs)

    # -- the background side ---------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="async-llm-collector", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        try:
            for data in self.collector:
                self._ready.put(data)
                self._collected += 1
                with self._allowed:
                    while not self._stop and self._collected >= self._asked + self.max_staleness:
                        self._allowed.wait()
                    if self._stop:
                        return
        except BaseException as error:  # handed to the trainer, raised there
            self._ready.put(error)
            return
        self._ready.put(_DONE)

    def _take(self) -> TensorDictBase | None:
        item = self._ready.get()
        if item is _DONE:
            return None
        if isinstance(item, BaseException):
            raise item
        data: TensorDictBase = item
        return data

    def _oldest(self, data: TensorDictBase) -> list[int]:
        """Per row: the oldest version among its sampled tokens (rows without any left out)."""
        rows = data.reshape(-1).get(self.versions_key, as_list=True)  # type: ignore[call-overload]
        known = [torch.as_tensor(v) for v in rows]
        return [int(v[v >= 0].min()) for v in known if (v >= 0).any()]

    def _record(self, rows: int, staleness: list[int], wait_s: float) -> None:
        stats = self.stats
        stats.batches += 1
        stats.trajectories += rows
        stats.wait_s += wait_s
        for s in staleness:
            stats.staleness[s] = stats.staleness.get(s, 0) + 1

    # -- lifetime --------------------------------------------------------------------------

    def shutdown(self) -> None:
        with self._allowed:
            self._stop = True
            self._allowed.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)
        self.collector.shutdown()

    def __enter__(self) -> AsyncLLMCollector:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
