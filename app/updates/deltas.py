"""Deltas of the served weights (`app.weights.delta`) on this server: rebuilt from the served
tensors while serving goes on, each checked against its checksum, then written under the
usual pause; refused whole, the served weights untouched, at the first problem. Over HTTP,
from a path, and as bytes received over the collective transfer (`stage_delta_bytes`)."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from rlserve_client.weight_delta import DeltaHeader

from app.common.failures import Conflict, Unsupported, invalid
from app.common.roles import Role
from app.engine.base import ModelWeights
from app.engine.registry import ModelRegistry
from app.updates.outcome import updated
from app.updates.types import Applied, Publish
from app.weights.checkpoint import write_and_flush
from app.weights.delta import (
    Staged,
    check_base,
    is_delta_file,
    is_delta_folder,
    one_file,
    read_delta,
    stage,
)

T = TypeVar("T")


class DeltaUpdates:
    registry: ModelRegistry

    if TYPE_CHECKING:

        @property
        def uploads(self) -> Path: ...

        async def _file_work(
            self, work: Callable[..., T], *args: Any, role: Role = Role.CHECKPOINT
        ) -> T: ...

        async def _expected(self, staged: Staged, model: str, digest: str | None) -> None: ...

    async def delta_file(self, path: Path, role: Role) -> bytes | Path | None:
        """A delta at `path` as one file (a folder's parts gathered; a file as it is), or
        None when `path` is a full checkpoint."""
        if not await self._file_work(is_delta, path, role=role):
            return None
        if path.is_file():
            return path
        delta = await self._file_work(read_delta, path, role, role=role)
        return await self._file_work(one_file, delta, role=role)

    async def _apply_delta(self, path: Path, model: str, publish: Publish, role: Role) -> Applied:
        """Rebuild a delta's tensors from the served ones while serving goes on, check each
        against its checksum, then swap them in under `publish`'s pause; refused whole (the
        served weights untouched) at the first problem."""
        start = time.perf_counter()
        staged, header = await self._stage_delta(path, model, role)
        await self._expected(staged, model, publish.expect_digest)
        return await self._commit_delta(staged, model, _delta_publish(header, publish), start)

    async def _stage_delta(self, path: Path, model: str, role: Role) -> tuple[Staged, DeltaHeader]:
        delta = await self._file_work(read_delta, path, role, role=role)
        backend = self.delta_base(model, role)
        base = self.registry.versions[model]
        check_base(delta, base, self.registry.digests.of(model))
        layout = backend.weight_layout() or {}

        def tensor(name: str) -> torch.Tensor:
            found = backend.served_tensor(name)
            if found is None:
                raise invalid(role, f"unknown parameter '{name}' (not in the served model)")
            return found

        staged = await self._file_work(stage, delta, layout, tensor, base, role=role)
        return staged, delta.header

    def delta_base(self, model: str, role: Role) -> ModelWeights:
        """`model`'s weights, where a delta can build on them now (else refused naming
        `role`: an engine that takes full weights only, or served values it cannot show)."""
        backend = self.registry.weights(model)
        if not backend.capabilities.weight_deltas:
            raise Unsupported(
                f"the {backend.info.backend} engine takes full weights only for this "
                "model (vLLM: no local checkpoint, or tied embeddings it reloads stale)",
                role=role,
            )
        if (why := backend.delta_base_refusal()) is not None:
            raise Conflict(why, role=role)
        return backend

    async def stage_delta_bytes(
        self, blob: bytes, model: str, role: Role
    ) -> tuple[Staged, DeltaHeader]:
        """A delta received as bytes (over the collective transfer), staged against `model`'s
        served weights and checked as an uploaded one is (`_stage_delta`); its file is gone
        afterwards (the staged changes are in memory)."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.uploads, suffix=".safetensors") as sink:
            await self._file_work(write_and_flush, sink, [blob], role=role)
            return await self._stage_delta(Path(sink.name), model, role)

    async def commit_delta(
        self, staged: Staged, header: DeltaHeader, model: str, publish: Publish, start: float
    ) -> Applied:
        """Swap in a staged delta (`stage_delta_bytes`) as `publish` or the version it names."""
        return await self._commit_delta(staged, model, _delta_publish(header, publish), start)

    async def _commit_delta(
        self, staged: Staged, model: str, publish: Publish, start: float
    ) -> Applied:
        async with self.registry.writing(model, publish.commit()) as (target, version):
            if self.registry.versions[model] != staged.base_version:  # another came first
                raise Conflict(
                    f"version {self.registry.versions[model]} was committed "
                    f"while the delta of version {staged.base_version} was staged; nothing "
                    "was applied",
                    role=staged.role,
                )
            paused_at = time.perf_counter()
            await target.write_tensors(staged.changes)
            changed, known = staged.changes, staged.checksums
            await self.registry.digests.record(model, target, changed, known)
            paused = time.perf_counter() - paused_at
        applied = updated(
            self.registry.versions,
            model,
            version,
            len(staged.changes),
            staged.num_bytes,
            paused,
            start,
            digest=self.registry.digests.of(model),
            snapshot=publish.snapshot,
        )
        return replace(applied, sent_bytes=staged.compressed_bytes)


def is_delta(path: Path) -> bool:
    return is_delta_folder(path) if path.is_dir() else path.is_file() and is_delta_file(path)


def _delta_publish(header: DeltaHeader, publish: Publish) -> Publish:
    """The version a delta is served as: the request's, or the one the delta names."""
    if header.version is None or publish.version == header.version:
        return publish
    if publish.version is None:
        return replace(publish, version=header.version)
    raise invalid(
        Role.VERSION,
        f"the request names version {publish.version}, the delta {header.version}",
    )
