"""A local checkpoint kept up to date with published versions: slime's disk deltas (SGLang's
`POST /pull_weights` as slime's SGLang patch defines it) and SkyRL's checkpoint deltas
(its `/fetch_weights`).

A trainer publishes each version `N` as a folder under a shared source folder (`Stream`:
slime's `weight_v{N:06d}`, a full checkpoint, or a delta of version N-1 whose index metadata
names the encoding; SkyRL's `delta-{N:08d}`, always a delta, its manifest written last;
`app.weights.delta` reads both). Pulling version N brings a host-local checkpoint to it: from
the newest full version at or below N (version 0 is the model the server started from), or
from the local checkpoint's own version when that is as new, then each delta in order. The
server then loads the local checkpoint as any other (`update_weights_from_disk`).

Unlike an in-place patch, each changed file is rebuilt beside the local one and verified
(every tensor's checksum) before any file is replaced, so a bad delta leaves the local
checkpoint as it was; a pull cut short while files were being replaced is noticed by the next
pull, which rebuilds the checkpoint from its seed. Pulls on one host (replicas sharing the
folder) are serialized by a file lock."""

from __future__ import annotations

import contextlib
import fcntl
import json
import mmap
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rlserve_client import weight_delta as codec

from app.common.failures import Conflict, Malformed, NotFound, invalid
from app.common.roles import Role
from app.weights.checkpoint import safetensors_header
from app.weights.delta import Delta, is_delta_folder, read_delta, read_skyrl_delta

SYNC = ".weight_sync"
STATE = "state.json"
REPLACING = "replacing"


@dataclass(frozen=True)
class Stream:
    """How a trainer lays out its published versions."""

    folder: Callable[[int], str]
    """Version N's folder name."""
    is_delta: Callable[[Path], bool]
    """Whether a published folder is a delta (else a full checkpoint)."""
    read: Callable[[Path, Role], Delta]


SLIME = Stream(lambda version: f"weight_v{version:06d}", is_delta_folder, read_delta)
SKYRL = Stream(lambda version: f"delta-{version:08d}", lambda _: True, read_skyrl_delta)
STREAMS = {"slime": SLIME, "skyrl": SKYRL}


def pull(local: Path, base: Path | str, source: Path, target: int, stream: Stream = SLIME) -> int:
    """Bring `local` to version `target` of `source` (seeded from `base`, the served model's
    own checkpoint, for version 0: or why there is none); the version it holds after. Raises
    naming the fields of `/pull_weights`; the local checkpoint is never left part of one
    version."""
    local.mkdir(parents=True, exist_ok=True)
    (local / SYNC).mkdir(exist_ok=True)
    with _locked(local / SYNC / "lock"):
        for leftover in local.glob("*.next"):  # a pull cut short before it replaced them
            leftover.unlink()
        held = _held(local, source)
        if (local / SYNC / REPLACING).exists():
            held = None  # cut short while replacing files: rebuilt from its seed
        if held is not None and held > target:
            held = None  # a trainer counting again (restarted): rebuilt from its seed
        floor = held if held is not None else 0
        start = target
        while start > floor and _is_delta(source / stream.folder(start), stream):
            start -= 1
        if held is None or start > held:
            if start == 0 and isinstance(base, str):
                raise NotFound(
                    f"no full version at or below {target} is published, and the "
                    f"model's own checkpoint cannot seed the local one ({base})",
                    role=Role.PUBLISHED,
                )
            seed = base if start == 0 else source / stream.folder(start)
            assert isinstance(seed, Path)
            _seed(seed, local, start, source)
        else:
            start = held
        for version in range(start + 1, target + 1):
            _apply(local, source, version, stream)
        return target


def _is_delta(folder: Path, stream: Stream) -> bool:
    if not folder.is_dir():
        raise NotFound(f"no published version {folder.name}", role=Role.PUBLISHED)
    return stream.is_delta(folder)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _held(local: Path, source: Path) -> int | None:
    """The version `local` holds of `source`'s (None: none, or another source's)."""
    try:
        state = json.loads((local / SYNC / STATE).read_text())
        if state.get("source", str(source)) != str(source):
            return None  # another trainer's versions: rebuilt from the seed
        return int(state["version"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # unreadable: rebuilt from the seed


def _write_held(local: Path, version: int, source: Path) -> None:
    tmp = local / SYNC / (STATE + ".tmp")
    tmp.write_text(json.dumps({"version": f"{version:06d}", "source": str(source)}))
    os.replace(tmp, local / SYNC / STATE)


def _seed(folder: Path, local: Path, version: int, source: Path) -> None:
    """`local` made a copy of the full checkpoint in `folder` (files it lacks removed)."""
    if not folder.is_dir():
        raise NotFound(f"no checkpoint folder {folder}", role=Role.PUBLISHED)
    (local / SYNC / REPLACING).touch()
    files = [entry for entry in folder.iterdir() if entry.is_file()]
    for entry in files:
        shutil.copyfile(entry, local / (entry.name + ".part"))
        os.replace(local / (entry.name + ".part"), local / entry.name)
    names = {entry.name for entry in files}
    for entry in local.iterdir():
        if entry.is_file() and entry.name not in names:
            entry.unlink()
    _write_held(local, version, source)
    (local / SYNC / REPLACING).unlink()


def _locations(local: Path) -> dict[str, tuple[Path, int, int]]:
    found: dict[str, tuple[Path, int, int]] = {}
    for path in sorted(local.glob("*.safetensors")):
        size, header = safetensors_header(path)
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                found[name] = (path, 8 + size + begin, end - begin)
    return found


def _apply(local: Path, source: Path, version: int, stream: Stream) -> None:
    """One delta applied to copies of the files it changes; the copies replace the files only
    once every tensor matched its checksum."""
    role = Role.PUBLISHED
    folder = source / stream.folder(version)
    delta = stream.read(folder, role)
    held = _held(local, source)
    if delta.header.base_version != held:
        raise Conflict(
            f"{folder.name} builds on version {delta.header.base_version}, the local "
            f"checkpoint holds {held}",
            role=role,
        )
    if delta.header.version is not None and delta.header.version != version:
        raise Malformed(f"{folder.name} says it is version {delta.header.version}", role=role)
    locations = _locations(local)
    copies: dict[Path, Path] = {}
    try:
        for part in delta.parts:
            if part.name not in locations:
                raise invalid(role, f"{folder.name} changes '{part.name}', which is not in it")
            path, offset, size = locations[part.name]
            if path not in copies:
                copies[path] = path.with_name(path.name + ".next")
                shutil.copyfile(path, copies[path])
            with part.path.open("rb") as f:
                f.seek(part.offset)
                frame = f.read(part.size)
            with copies[path].open("r+b") as handle, mmap.mmap(handle.fileno(), 0) as mapped:
                region = np.ndarray((size,), dtype=np.uint8, buffer=mapped, offset=offset)
                try:
                    codec.apply(region, frame, part.encoding)
                except ValueError as exc:
                    message = f"{folder.name}, '{part.name}': {exc}"
                    raise Malformed(message, role=role) from None
                got = codec.checksum(region, delta.header.checksum_format)
                del region
            if got != part.checksum:
                raise Conflict(
                    f"{folder.name}: '{part.name}' does not rebuild to its checksum "
                    f"({got}, not {part.checksum}); the local checkpoint stays at version {held}",
                    role=role,
                )
        (local / SYNC / REPLACING).touch()
        for path, copy in copies.items():
            os.replace(copy, path)
        copies.clear()
        _write_held(local, version, source)
        (local / SYNC / REPLACING).unlink()
    finally:
        for copy in copies.values():
            copy.unlink(missing_ok=True)
