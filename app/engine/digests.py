"""Each served model's weight digest: the checksum of its tensors' checksums
(`rlserve_client.weight_delta.digest`), so a trainer can check that the weights served are its
own, not only that a version number went up. Kept per tensor, so an update re-hashes only what
it changed (a delta's tensors come with checksums already checked)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from rlserve_client.weight_delta import digest

from app.engine.base import ModelWeights

logger = logging.getLogger(__name__)


class Digests:
    def __init__(self) -> None:
        self._checksums: dict[str, dict[str, str]] = {}
        self._digests: dict[str, str] = {}

    def of(self, name: str) -> str | None:
        """`name`'s digest; None when its engine cannot show its weights (a vLLM engine
        serving no local checkpoint, or tensors a collective transfer set)."""
        return self._digests.get(name)

    def all(self) -> dict[str, str]:
        return dict(self._digests)

    async def record_all(self, name: str, backend: ModelWeights) -> None:
        """Hash every tensor of `name` (at start). A model whose tensors cannot be hashed is
        served without a digest (said once in the log), never refused."""
        try:
            checksums = await asyncio.to_thread(backend.weight_checksums)
        except Exception:  # (a tensor the engine cannot read as bytes: no digest, no refusal)
            logger.exception("no weight digest for %s", name)
            self._forget(name)
            return
        if checksums is None:
            self._forget(name)
        else:
            self._set(name, checksums)

    async def record(
        self,
        name: str,
        backend: ModelWeights,
        changed: Iterable[str],
        known: Mapping[str, str] | None = None,
    ) -> None:
        """`changed` tensors of `name` were just written (while serving is paused): hash them
        (and the names tied to them) again, but for the `known` checksums (checked already).
        A name the model's own tensors do not have (a fused expert's part), or a model not
        hashed yet, hashes the whole model."""
        table = self._checksums.get(name)
        changed = set(changed)
        if table is None or not changed <= table.keys():
            await self.record_all(name, backend)
            return
        try:
            fresh = await asyncio.to_thread(backend.weight_checksums, changed, known)
        except Exception:  # (the weights are written: the update stands, without a digest)
            logger.exception("no weight digest for %s after its update", name)
            self._forget(name)
            return
        if fresh is None:  # (the engine no longer shows its weights: no digest from now on)
            self._forget(name)
        else:
            self._set(name, {**table, **fresh})

    def predict(self, name: str, checksums: Mapping[str, str]) -> str | None:
        """`name`'s digest once tensors with these checksums are written (None: unknown)."""
        table = self._checksums.get(name)
        if table is None or not checksums.keys() <= table.keys():
            return None
        return digest({**table, **checksums})

    def _forget(self, name: str) -> None:
        self._checksums.pop(name, None)
        self._digests.pop(name, None)

    def _set(self, name: str, checksums: dict[str, str]) -> None:
        self._checksums[name] = checksums
        self._digests[name] = digest(checksums)
