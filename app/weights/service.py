"""Weight updates: check a safetensors checkpoint against the served model, then swap it in
while all model work is paused; the version goes up only when the update succeeded."""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from app.common.failures import Conflict, Malformed, TimedOut, TooLarge
from app.config import Settings
from app.engine.gate import GateState
from app.engine.registry import ModelRegistry
from app.weights.checkpoint import (
    check_finite,
    check_layout,
    checkpoint_files,
    read_layout,
    read_whole,
    snapshot,
)
from app.weights.protocol import (
    LoadWeightsRequest,
    PauseMode,
    TransferFinish,
    TransferInit,
    TransferState,
    TransferUpdate,
    UpdateOptions,
    WeightsUpdated,
    WeightsVersion,
)

if TYPE_CHECKING:
    from app.weights.transfer import TransferService

logger = logging.getLogger(__name__)
T = TypeVar("T")
_WRITE_BATCH_BYTES = 8 << 20
_DISK_RESERVE = 64 << 20  # left free for the session store and logs


@dataclass(frozen=True)
class Checked:
    """A checkpoint that passed every check and may be applied."""

    files: list[Path]
    num_tensors: int
    num_bytes: int


class WeightsService:
    def __init__(self, registry: ModelRegistry, settings: Settings) -> None:
        self.registry = registry
        self.settings = settings
        self._staged: dict[str, Checked] = {}
        self.fanout: Fanout | None = None
        """Set on a replica of several (app.deploy): loads and uploads reach every replica."""

    async def pause(self, mode: PauseMode, *, here_only: bool = False) -> GateState:
        """Pause serving here, or on every replica when this is one of several."""
        if self.fanout is not None and not here_only:
            return await self.fanout.pause(mode)
        return await self.registry.gate.pause(mode)

    async def resume(self, *, here_only: bool = False) -> GateState:
        if self.fanout is not None and not here_only:
            return await self.fanout.resume()
        return await self.registry.gate.resume()

    def version(self) -> WeightsVersion:
        versions = self.registry.versions
        return WeightsVersion(
            policy_version=versions["policy"], reference_version=versions["reference"]
        )

    @property
    def uploads(self) -> Path:
        return self.settings.data_dir / "uploads"

    def clean_uploads(self) -> None:
        """Remove uploads a killed server left behind (at start-up, before any upload)."""
        for leftover in self.uploads.glob("*.safetensors"):
            leftover.unlink(missing_ok=True)

    async def load(self, request: LoadWeightsRequest) -> WeightsUpdated:
        """Load a checkpoint the server can read. By default from a private snapshot taken
        first, so a checkpoint rewritten during the load is applied whole or not at all. On
        a replica of several, every replica loads it, as one transaction."""
        files = await self._file_work(checkpoint_files, Path(request.path))
        if self.fanout is not None:  # read once here, shipped to every replica
            contents = await self._file_work(read_whole, files, "path")
            return await self.fanout.update(contents, request.model, request, "path")
        if not self.settings.weights_snapshot_loads:
            return await self._apply(files, request.model, "path", request)
        self.uploads.mkdir(parents=True, exist_ok=True)
        needed = sum(f.stat().st_size for f in files)
        room = self._disk_room()
        if needed > room:
            raise TooLarge(
                f"path: the checkpoint ({needed} bytes) does not fit the free disk ({room} "
                "bytes) for its snapshot; free space or set RLSERVE_WEIGHTS_SNAPSHOT_LOADS=false",
                param="path",
            )
        copies = await self._file_work(snapshot, files, self.uploads, "path")
        try:
            return await self._apply(copies, request.model, "path", request)
        finally:
            for copy in copies:
                copy.unlink(missing_ok=True)

    def _disk_room(self) -> int:
        """Bytes a snapshot or upload may take: the free disk less a reserve."""
        return shutil.disk_usage(self.uploads).free - _DISK_RESERVE

    async def upload(
        self, chunks: AsyncIterator[bytes], model: str, options: UpdateOptions
    ) -> WeightsUpdated:
        """Stream the body to a file on disk (memory stays bounded; writes in a thread), then
        apply it. The file is gone afterwards, whatever happened (a client that went away
        included); the limit is max_weights_bytes or the free disk space, the smaller."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        room = self._disk_room()
        limit = min(self.settings.max_weights_bytes, room)
        with tempfile.NamedTemporaryFile(dir=self.uploads, suffix=".safetensors") as sink:
            size = written = 0
            pending: list[bytes] = []  # written in ~8 MiB batches: one thread hop each
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise TooLarge(
                        f"body: the upload exceeds {max(limit, 0)} bytes "
                        f"(max_weights_bytes {self.settings.max_weights_bytes}, "
                        f"free disk {room + _DISK_RESERVE})",
                        param="body",
                    )
                pending.append(chunk)
                if size - written >= _WRITE_BATCH_BYTES:
                    await asyncio.to_thread(sink.writelines, pending)
                    pending, written = [], size
            await asyncio.to_thread(_write_and_flush, sink, pending)
            if size == 0:
                raise Malformed("body: the upload is empty", param="body")
            if self.fanout is not None:
                data = await asyncio.to_thread(Path(sink.name).read_bytes)
                return await self.fanout.update({"model.safetensors": data}, model, options, "body")
            return await self._apply([Path(sink.name)], model, "body", options)

    async def _file_work(self, work: Callable[..., T], *args: Any) -> T:
        """Checkpoint file work in a thread, bounded in time: a file that blocks (a FIFO, a
        hung network mount) costs a 504, never the event loop."""
        timeout = self.settings.weights_io_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.to_thread(work, *args)
        except TimeoutError:
            raise TimedOut(f"reading the checkpoint took over {timeout:g} s") from None

    async def _apply(
        self, files: list[Path], model: str, param: str, options: UpdateOptions
    ) -> WeightsUpdated:
        checked = await self._check(files, model, param)
        return await self._commit(checked, model, options)

    async def _check(self, files: list[Path], model: str, param: str) -> Checked:
        """Everything that can refuse a checkpoint, before serving is touched."""
        update = await self._file_work(read_layout, files, param)
        served = self.registry.get(model)
        expected = served.backend.weight_layout()
        if expected is not None:
            check_layout(update, expected)
        served.backend.check_update(set(update), param)
        await self._file_work(check_finite, files, param)
        return Checked(files, len(update), sum(f.stat().st_size for f in files))

    async def _commit(self, checked: Checked, model: str, options: UpdateOptions) -> WeightsUpdated:
        start = time.perf_counter()
        async with self.registry.writing(model, mode=options.pause, version=options.version) as (
            target,
            version,
        ):
            paused_at = time.perf_counter()
            await target.backend.update_weights(checked.files)
            paused = time.perf_counter() - paused_at
        return self.updated(model, version, checked.num_tensors, checked.num_bytes, paused, start)

    # -- one update over several replicas (app.deploy.fanout): stage, then commit or abort --

    async def stage(self, update_id: str, files: dict[str, bytes], model: str, param: str) -> int:
        """Write a checkpoint's files (name to bytes) into this server's data and check them,
        without touching serving; the current version of `model`. Whatever goes wrong raises
        (naming `param`, the request field the checkpoint came from) and leaves nothing
        staged."""
        self.uploads.mkdir(parents=True, exist_ok=True)
        folder = self.uploads / f"staged-{update_id}"
        try:
            folder.mkdir()
            copies = [folder / Path(name).name for name in sorted(files)]
            for copy in copies:
                await self._file_work(copy.write_bytes, files[copy.name])
            self._staged[update_id] = await self._check(copies, model, param)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return self.registry.versions[model]

    async def commit_staged(
        self, update_id: str, model: str, options: UpdateOptions
    ) -> WeightsUpdated:
        checked = self._staged.pop(update_id, None)
        if checked is None:
            raise Conflict(f"no update '{update_id}' is staged here", param="update")
        try:
            return await self._commit(checked, model, options)
        finally:
            shutil.rmtree(self.uploads / f"staged-{update_id}", ignore_errors=True)

    def has_staged(self, update_id: str) -> bool:
        return update_id in self._staged

    def abort_staged(self, update_id: str) -> None:
        self._staged.pop(update_id, None)
        shutil.rmtree(self.uploads / f"staged-{update_id}", ignore_errors=True)

    async def adopt(self, model: str, version: int, files: dict[str, bytes]) -> WeightsUpdated:
        """Serve a checkpoint the other replicas committed as `version` (a replica catching
        up before it takes traffic)."""
        update_id = f"adopt-{model}-{version}"
        await self.stage(update_id, files, model, "path")
        return await self.commit_staged(update_id, model, UpdateOptions(version=version))

    def updated(
        self,
        model: str,
        version: int,
        num_tensors: int,
        num_bytes: int,
        paused: float,
        start: float,
    ) -> WeightsUpdated:
        """The answer to a committed update; `version` is the one this update published."""
        logger.info(
            "loaded %d tensors (%d bytes) into %s as version %d; serving paused %.3f s",
            num_tensors,
            num_bytes,
            model,
            version,
            paused,
        )
        versions = dict(self.registry.versions, **{model: version})
        return WeightsUpdated(
            model=model,  # type: ignore[arg-type]
            policy_version=versions["policy"],
            reference_version=versions["reference"],
            num_tensors=num_tensors,
            num_bytes=num_bytes,
            seconds=paused,
            total_seconds=time.perf_counter() - start,
        )


class Fanout(Protocol):
    async def update(
        self, files: dict[str, bytes], model: str, options: UpdateOptions, param: str
    ) -> WeightsUpdated:
        """Apply a checkpoint (its files' bytes by name) on every replica, or on none."""

    async def catch_up(self, weights: WeightsService) -> None:
        """Bring this replica to what the others serve, before it takes traffic."""

    async def pause(self, mode: PauseMode) -> GateState:
        """Pause every replica; this one's state afterwards."""

    async def resume(self) -> GateState: ...

    async def transfer_state(self, model: str) -> TransferState:
        """Every replica's collective-transfer state, as one."""

    async def transfer_init(self, request: TransferInit) -> TransferState:
        """Every replica joins the trainer's group, each at its own ranks."""

    async def transfer_step(
        self, step: Literal["start", "abort", "close"], model: str
    ) -> TransferState: ...

    async def transfer_update(self, request: TransferUpdate) -> TransferState: ...

    async def transfer_finish(
        self, request: TransferFinish, here: TransferService
    ) -> WeightsUpdated:
        """Commit the received update on every replica under one version, or on none."""


def _write_and_flush(sink: Any, chunks: list[bytes]) -> None:
    sink.writelines(chunks)
    sink.flush()
