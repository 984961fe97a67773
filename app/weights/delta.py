"""Weight deltas on the server: read one (a file sent whole, or a published version folder in
slime's layout), and stage it: each changed tensor rebuilt from the served one into a copy of
its own and checked against the checksum the sender wrote, while the model serves on. Nothing
is applied unless every tensor of the version rebuilt exactly; the commit then only copies.
The format and its codec are `rlserve_client.weight_delta`'s (server and trainers share it)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rlserve_client import weight_delta as codec

from app.common.failures import Conflict, Malformed, Unsupported, invalid
from app.weights.checkpoint import SAFETENSORS_TO_TORCH, Layout

__all__ = [
    "Delta",
    "Staged",
    "check_base",
    "is_delta_file",
    "is_delta_folder",
    "one_file",
    "read_delta",
    "stage",
]


@dataclass(frozen=True)
class Part:
    """One changed tensor of a delta: where its frame lies, and the checksum it must rebuild."""

    name: str
    path: Path
    offset: int
    size: int
    checksum: str
    encoding: str


@dataclass(frozen=True)
class Delta:
    header: codec.DeltaHeader
    parts: tuple[Part, ...]
    where: str
    """The request field it came from (named in every refusal)."""


@dataclass(frozen=True)
class Staged:
    """A delta rebuilt: the new tensors (the served dtype and shape) and their checksums."""

    base_version: int
    tensors: dict[str, torch.Tensor]
    checksums: dict[str, str]
    checksum_format: str
    compressed_bytes: int
    param: str
    """The request field the delta came from."""

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    with path.open("rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        if size > 100 << 20:
            raise ValueError(f"a header of {size} bytes")
        header: dict[str, Any] = json.loads(f.read(size))
    return size, header


def is_delta_file(path: Path) -> bool:
    """A safetensors file whose metadata declares it a delta (`codec.META_KEY`)."""
    try:
        _, header = _header(path)
    except (OSError, ValueError, struct.error):
        return False
    return codec.META_KEY in (header.get("__metadata__") or {})


def is_delta_folder(path: Path) -> bool:
    """A version folder whose index metadata names a delta encoding (slime's published
    deltas); a folder without one is a full checkpoint."""
    try:
        index = json.loads((path / codec.INDEX).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and "delta_encoding" in (index.get("metadata") or {})


def read_delta(path: Path, param: str) -> Delta:
    """The delta in file or folder `path`: its header and parts, read from the headers only.
    Refusals name `param`."""
    try:
        if path.is_dir():
            metadata = json.loads((path / codec.INDEX).read_text())["metadata"]
            files = sorted(path.glob("*.safetensors"))
        else:
            _, top = _header(path)
            metadata = json.loads((top.get("__metadata__") or {})[codec.META_KEY])
            files = [path]
        header = codec.header_of(metadata, param)
        parts: list[Part] = []
        for file in files:
            size, tensors = _header(file)
            sums = tensors.pop("__metadata__", None) or {}
            for name, info in tensors.items():
                begin, end = info["data_offsets"]
                if info.get("dtype") != "U8" or name not in sums:
                    raise ValueError(f"tensor '{name}' is not a compressed change with a checksum")
                encoding = header.encodings.get(name, header.encoding)
                parts.append(Part(name, file, 8 + size + begin, end - begin, sums[name], encoding))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise Malformed(f"{param}: not a weight delta ({exc})", param=param) from None
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise Malformed(f"{param}: the delta names a tensor twice", param=param)
    _check_header(header, param)
    return Delta(header, tuple(parts), param)


def one_file(delta: Delta) -> bytes:
    """`delta` (read from a folder, say) as one file, its header in the file's metadata: what
    a deployment ships to its replicas."""
    from safetensors.numpy import save

    frames: dict[str, np.ndarray] = {}
    for part in delta.parts:
        with part.path.open("rb") as f:
            f.seek(part.offset)
            frames[part.name] = np.frombuffer(f.read(part.size), dtype=np.uint8)
    encodings = {p.name: p.encoding for p in delta.parts if p.encoding != delta.header.encoding}
    header = replace(delta.header, encodings=encodings)
    metadata = {p.name: p.checksum for p in delta.parts}
    metadata[codec.META_KEY] = json.dumps(header.metadata(), sort_keys=True)
    return save(frames, metadata=metadata)


def _check_header(header: codec.DeltaHeader, param: str) -> None:
    if header.compression_format != "zstd":
        raise Unsupported(
            f"{param}: compression '{header.compression_format}' (deltas are zstd-compressed)",
            param=param,
        )
    for encoding in {header.encoding, *header.encodings.values()}:
        if encoding not in codec.ENCODINGS:
            raise Unsupported(
                f"{param}: delta encoding '{encoding}' is not one of {list(codec.ENCODINGS)}",
                param=param,
            )
    if header.checksum_format not in codec.CHECKSUMS:
        raise Unsupported(
            f"{param}: checksum '{header.checksum_format}' is not one of {list(codec.CHECKSUMS)}",
            param=param,
        )
    try:
        codec.hasher(header.checksum_format)
    except ImportError:
        raise Unsupported(
            f"{param}: checksum '{header.checksum_format}' needs a package this server lacks",
            param=param,
        ) from None


def check_base(delta: Delta, served_version: int, served_digest: str | None) -> None:
    """Refuse a delta built on other weights than those served (by version, and by digest
    when the delta names its base's)."""
    header, param = delta.header, delta.where
    if header.base_version != served_version:
        raise Conflict(
            f"{param}: the delta builds on version {header.base_version}, but version "
            f"{served_version} is served: send the full weights, or a delta of them",
            param=param,
        )
    known = header.base_digest is not None and served_digest is not None
    if known and header.base_digest != served_digest:
        raise Conflict(
            f"{param}: the delta builds on weights with digest {header.base_digest}, but "
            f"those served have {served_digest}",
            param=param,
        )


def stage(
    delta: Delta, layout: Layout, served: Callable[[str], torch.Tensor], base_version: int
) -> Staged:
    """Rebuild every changed tensor from `served(name)` (the served tensor) in a copy, and
    check each against its checksum; raises at the first problem, naming the tensor. Runs
    off the event loop (reads files, decompresses, hashes)."""
    param = delta.where
    tensors: dict[str, torch.Tensor] = {}
    checksums: dict[str, str] = {}
    compressed = 0
    for part in delta.parts:
        if part.name not in layout:
            raise invalid(param, f"unknown parameter '{part.name}' (not in the served model)")
        dtype_name, shape = layout[part.name]
        dtype = SAFETENSORS_TO_TORCH.get(dtype_name)
        if dtype is None:
            raise Unsupported(f"{param}: '{part.name}' has dtype {dtype_name}", param=param)
        new = served(part.name).detach().to("cpu", copy=True).contiguous()
        region = new.reshape(-1).view(torch.uint8).numpy()
        with part.path.open("rb") as f:
            f.seek(part.offset)
            frame = f.read(part.size)
        if len(frame) != part.size:
            raise Malformed(f"{param}: the delta is truncated at '{part.name}'", param=param)
        compressed += part.size
        try:
            codec.apply(region, frame, part.encoding)
        except ValueError as exc:
            raise Malformed(f"{param}: tensor '{part.name}': {exc}", param=param) from None
        got = codec.checksum(region, delta.header.checksum_format)
        if got != part.checksum:
            raise Conflict(
                f"{param}: tensor '{part.name}' does not rebuild to its checksum (got {got}, "
                f"the delta says {part.checksum}): a corrupt delta, or another base than the "
                "served weights; nothing was applied",
                param=param,
            )
        if dtype.is_floating_point and not bool(torch.isfinite(new).all()):
            raise invalid(param, f"tensor '{part.name}' holds NaN or infinite values")
        tensors[part.name] = new.view(shape)
        checksums[part.name] = got
    return Staged(base_version, tensors, checksums, delta.header.checksum_format, compressed, param)
