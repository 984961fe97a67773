"""Checkpoint updates on this server: check a safetensors checkpoint against the served model,
then swap it in while all model work is paused; the version goes up only when the update
succeeded. Also each step a replica of several takes in one update over all of them
(`app.deploy.replicated`): stage, then commit or abort."""

from __future__ import annotations

import asyncio
import contextlib
import math
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.common.failures import Conflict, Failure, Malformed, TooLarge, Unsupported
from app.common.roles import Role
from app.config_groups import WeightSettings
from app.engine.registry import ModelRegistry
from app.updates.deltas import DeltaUpdates, is_delta
from app.updates.origin import origin_checkpoint
from app.updates.outcome import updated
from app.updates.types import Applied, Publish, Streamed
from app.weights import published
from app.weights.checkpoint import (
    SAFETENSORS_TO_TORCH,
    check_finite,
    check_layout,
    checkpoint_files,
    file_checksums,
    file_work,
    read_layout,
    snapshot,
    to_safetensors,
    write_and_flush,
)
from app.weights.delta import (
    Staged,
    is_delta_file,
)
from app.weights.shipment import CHUNK_BYTES, Put, Shipment, ship

T = TypeVar("T")
_WRITE_BATCH_BYTES = 8 << 20
_DISK_RESERVE = 64 << 20  # left free for the session store and logs


@dataclass(frozen=True)
class Limit:
    """The most bytes an upload may hold, and the setting that says so."""

    bytes: int
    setting: str


@dataclass(frozen=True)
class Checked:
    """A checkpoint that passed every check and may be applied."""

    files: list[Path]
    names: list[str]
    num_tensors: int
    num_bytes: int


class WeightsService(DeltaUpdates):
    """(Deltas of the served weights: `DeltaUpdates`, `app.updates.deltas`.)"""

    def __init__(self, registry: ModelRegistry, settings: WeightSettings, data_dir: Path) -> None:
        self.registry = registry
        self.settings = settings
        self.data_dir = data_dir
        self._staged: dict[str, Checked | Staged] = {}

    @property
    def uploads(self) -> Path:
        return self.data_dir / "uploads"

    def clean_uploads(self) -> None:
        """Remove uploads a killed server left behind (at start-up, before any upload)."""
        for leftover in self.uploads.glob("*.safetensors"):
            leftover.unlink(missing_ok=True)

    async def load(
        self, path: str, model: str, publish: Publish, *, role: Role = Role.CHECKPOINT
    ) -> Applied:
        """Load a checkpoint the server can read (refusals name `role`). By default from a
        private snapshot taken first, so a checkpoint rewritten during the load is applied
        whole or not at all. A delta (a folder or file `app.weights.delta` reads as one) is
        rebuilt from the served weights."""
        self.registry.weights(model)  # (a model not served is refused first)
        if await self._file_work(is_delta, Path(path), role=role):
            return await self._apply_delta(Path(path), model, publish, role)
        files = await self._file_work(checkpoint_files, Path(path), role, role=role)
        if not self.settings.snapshot_loads:
            return await self._apply(files, model, role, publish)
        self.uploads.mkdir(parents=True, exist_ok=True)
        needed = sum(f.stat().st_size for f in files)
        room = self._disk_room()
        if needed > room:
            raise TooLarge(
                f"the checkpoint ({needed} bytes) does not fit the free disk ({room} "
                "bytes) for its snapshot; free space or set RLSERVE_WEIGHTS__SNAPSHOT_LOADS=false",
                role=role,
            )
        copies = await self._file_work(snapshot, files, self.uploads, role, role=role)
        try:
            return await self._apply(copies, model, role, publish)
        finally:
            for copy in copies:
                copy.unlink(missing_ok=True)

    def checkpoint_bytes(self, model: str) -> int:
        """The bytes of `model`'s whole checkpoint (its tensors')."""
        layout = self.registry.weights(model).weight_layout() or {}
        return sum(
            math.prod(shape) * SAFETENSORS_TO_TORCH[dtype].itemsize
            for dtype, shape in layout.values()
            if dtype in SAFETENSORS_TO_TORCH
        )

    async def served_checkpoint(self, model: str) -> bytes:
        """The weights `model` serves now, as one safetensors file."""
        backend = self.registry.weights(model)
        names = list(backend.weight_layout() or {})

        def whole() -> bytes:
            state = {}
            for name in names:
                if (tensor := backend.served_tensor(name)) is not None:
                    state[name] = tensor.detach().to("cpu").contiguous()
            return to_safetensors(state)

        return await asyncio.to_thread(whole)

    async def pull(
        self,
        local: Path | None,
        source: Path,
        target: int,
        stream: str = "slime",
        model: str = "policy",
    ) -> Path:
        """Bring the local checkpoint `local` (None: one of the server's own, for `source`) to
        version `target` of those published under `source` as `stream` lays them out
        (`app.weights.published`; version 0 is `model`'s starting checkpoint), and say where
        it is; the server then loads it as any checkpoint. Serving is not touched."""
        if local is None:  # (one per stream: another source's versions rebuild it)
            local = self.data_dir / "published" / stream
        try:
            base: Path | str = await self.origin(model)
        except Failure as exc:  # (needed only when no full version is published)
            base = exc.reason
        work, layout = published.pull, published.STREAMS[stream]
        await self._file_work(work, local, base, source, target, layout, role=Role.PUBLISHED)
        return local

    async def origin(self, model: str) -> Path:
        """The checkpoint `model` started from, unchanged since (POST /v1/weights/restore)."""
        return await self._file_work(
            origin_checkpoint, self.registry.origin(model), role=Role.MODEL
        )

    async def ship(
        self, files: Mapping[str, Path], put: Put, role: Role, chunk_bytes: int = CHUNK_BYTES
    ) -> Shipment:
        """Files (by the name they travel under) read chunk by chunk into `put`, for other
        servers to stage; refusals name `role`, what they are to the request."""
        return await self._file_work(ship, files, put, role, chunk_bytes, role=role)

    async def ship_checkpoint(
        self, path: str, put: Put, chunk_bytes: int = CHUNK_BYTES, *, role: Role = Role.CHECKPOINT
    ) -> Shipment:
        """The checkpoint at `path` (one this server can read), shipped as `ship` does."""
        found = await self._file_work(checkpoint_files, Path(path), role, role=role)
        return await self.ship({f.name: f for f in found}, put, role, chunk_bytes)

    def _disk_room(self) -> int:
        """Bytes a snapshot or upload may take: the free disk less a reserve."""
        return shutil.disk_usage(self.uploads).free - _DISK_RESERVE

    async def upload(self, body: Streamed, model: str, publish: Publish) -> Applied:
        """Stream the body to a file on disk, then apply it."""
        self.registry.weights(model)  # (a model not served is refused before the body)
        async with self.received(body, self.upload_limit()) as path:
            if await self._file_work(is_delta_file, path, role=Role.UPLOAD):
                return await self._apply_delta(path, model, publish, Role.UPLOAD)
            return await self._apply([path], model, Role.UPLOAD, publish)

    def upload_limit(self) -> Limit:
        return Limit(self.settings.max_bytes, "weights.max_bytes (RLSERVE_WEIGHTS__MAX_BYTES)")

    @contextlib.asynccontextmanager
    async def received(self, body: Streamed, bound: Limit) -> AsyncIterator[Path]:
        """The body streamed to a file on disk (memory stays bounded; writes in a thread). The
        file is gone afterwards, whatever happened (a client that went away included). The
        limit is `bound` or the free disk space, the smaller: a body declared larger (its
        Content-Length) is refused before a chunk is read, one that grows larger as soon as
        it does."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        room = self._disk_room()
        limit = min(bound.bytes, room)

        def too_large(size: str) -> TooLarge:
            return TooLarge(
                f"the upload ({size}) exceeds {max(limit, 0)} bytes ({bound.setting} "
                f"{bound.bytes}, free disk {room + _DISK_RESERVE})",
                role=Role.UPLOAD,
            )

        if body.size is not None and body.size > limit:
            raise too_large(f"{body.size} bytes declared")
        with tempfile.NamedTemporaryFile(dir=self.uploads, suffix=".safetensors") as sink:
            size = written = 0
            pending: list[bytes] = []  # written in ~8 MiB batches: one thread hop each
            async for chunk in body.chunks:
                size += len(chunk)
                if size > limit:
                    raise too_large(f"over {size} bytes so far")
                pending.append(chunk)
                if size - written >= _WRITE_BATCH_BYTES:
                    await asyncio.to_thread(sink.writelines, pending)
                    pending, written = [], size
            await asyncio.to_thread(write_and_flush, sink, pending)
            if size == 0:
                raise Malformed("the upload is empty", role=Role.UPLOAD)
            yield Path(sink.name)

    @contextlib.asynccontextmanager
    async def unpacked(self, shipment: Shipment) -> AsyncIterator[Path]:
        """A shipment of one file, written into this server's data chunk by chunk (gone
        afterwards)."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.uploads, suffix=".safetensors") as sink:
            for shipped in shipment.files:
                for chunk in shipped.chunks:
                    await self._file_work(sink.write, await chunk.fetch(), role=Role.UPLOAD)
            await self._file_work(sink.flush, role=Role.UPLOAD)
            yield Path(sink.name)

    async def _file_work(
        self, work: Callable[..., T], *args: Any, role: Role = Role.CHECKPOINT
    ) -> T:
        """`file_work` within the weights' I/O timeout."""
        return await file_work(work, *args, timeout_s=self.settings.io_timeout_s, role=role)

    async def _apply(self, files: list[Path], model: str, role: Role, publish: Publish) -> Applied:
        checked = await self._check(files, model, role)
        await self._expected(checked, model, publish.expect_digest)
        return await self._commit(checked, model, publish)

    async def _expected(self, staged: Checked | Staged, model: str, digest: str | None) -> None:
        """Refuse an update whose weights would not have `digest` (before anything is
        written)."""
        if digest is None:
            return
        if isinstance(staged, Staged):
            checksums = staged.checksums
        else:
            checksums = await self._file_work(file_checksums, staged.files, role=Role.DIGEST)
        predicted = self.registry.digests.predict(model, checksums)
        if predicted is None:
            engine = self.registry.weights(model).info.backend
            raise Unsupported(
                f"the {engine} engine does not show its weights, so their digest "
                "cannot be checked; send the update without one",
                role=Role.DIGEST,
            )
        if predicted != digest:
            raise Conflict(
                f"the weights would have digest {predicted}, not {digest}; nothing was applied",
                role=Role.DIGEST,
            )

    async def _check(self, files: list[Path], model: str, role: Role) -> Checked:
        """Everything that can refuse a checkpoint, before serving is touched."""
        update = await self._file_work(read_layout, files, role, role=role)
        served = self.registry.weights(model)
        expected = served.weight_layout()
        if expected is not None:
            check_layout(update, expected)
        served.check_update(set(update), role)
        await self._file_work(check_finite, files, role, role=role)
        return Checked(files, list(update), len(update), sum(f.stat().st_size for f in files))

    async def _commit(self, checked: Checked, model: str, publish: Publish) -> Applied:
        start = time.perf_counter()
        async with self.registry.writing(model, publish.commit()) as (target, version):
            paused_at = time.perf_counter()
            await target.update_weights(checked.files)
            await self.registry.digests.record(model, target, checked.names)
            paused = time.perf_counter() - paused_at
        versions = self.registry.versions
        return updated(
            versions,
            model,
            version,
            checked.num_tensors,
            checked.num_bytes,
            paused,
            start,
            digest=self.registry.digests.of(model),
            snapshot=publish.snapshot,
        )

    # -- deltas of the served weights (app.weights.delta) ------------------------------------

    # -- one update over several replicas (app.deploy.replicated): stage, then commit or abort

    async def stage(
        self,
        update_id: str,
        shipment: Shipment,
        model: str,
        role: Role,
        expect_digest: str | None = None,
    ) -> int:
        """Write a shipped checkpoint into this server's data, chunk by chunk, and check it,
        without touching serving; the current version of `model`. Whatever goes wrong raises
        (naming `role`, what the checkpoint is to the request) and leaves nothing
        staged."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        folder = self.uploads / f"staged-{update_id}"
        try:
            folder.mkdir()
            copies = []
            for shipped in sorted(shipment.files, key=lambda f: f.name):
                copies.append(copy := folder / Path(shipped.name).name)
                with copy.open("wb") as sink:
                    for chunk in shipped.chunks:
                        await self._file_work(sink.write, await chunk.fetch(), role=Role.UPLOAD)
            staged: Checked | Staged
            if len(copies) == 1 and await self._file_work(is_delta_file, copies[0], role=role):
                staged, _ = await self._stage_delta(copies[0], model, role)
            else:
                staged = await self._check(copies, model, role)
            await self._expected(staged, model, expect_digest)
            self._staged[update_id] = staged
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return self.registry.versions[model]

    async def commit_staged(self, update_id: str, model: str, publish: Publish) -> Applied:
        checked = self._staged.pop(update_id, None)
        if checked is None:
            raise Conflict(f"no update '{update_id}' is staged here", role=Role.STAGED_UPDATE)
        try:
            if isinstance(checked, Staged):
                return await self._commit_delta(checked, model, publish, time.perf_counter())
            return await self._commit(checked, model, publish)
        finally:
            shutil.rmtree(self.uploads / f"staged-{update_id}", ignore_errors=True)

    def has_staged(self, update_id: str) -> bool:
        return update_id in self._staged

    def has_any_staged(self) -> bool:
        return bool(self._staged)

    def abort_staged(self, update_id: str) -> None:
        self._staged.pop(update_id, None)
        shutil.rmtree(self.uploads / f"staged-{update_id}", ignore_errors=True)

    async def adopt(
        self, model: str, version: int, shipment: Shipment, snapshot: str | None = None
    ) -> Applied:
        """Serve a checkpoint the other replicas committed as `version` (a replica catching
        up before it takes traffic), published as snapshot `snapshot`, if one."""
        update_id = f"adopt-{model}-{version}"
        await self.stage(update_id, shipment, model, Role.CHECKPOINT)
        publish = Publish(version=version, snapshot=snapshot)
        return await self.commit_staged(update_id, model, publish)
