"""Weight deltas on the server: read one (a file sent whole, or a published version folder in
slime's layout), and stage it: each changed tensor rebuilt from the served one into a copy of
its own and checked against the checksum the sender wrote, while the model serves on. Nothing
is applied unless every tensor of the version rebuilt exactly; the commit then only copies.
The format and its codec are `rlserve_client.weight_delta`'s (server and trainers share it)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rlserve_client import weight_delta as codec

from app.common.failures import Conflict, Malformed, NotFound, Unsupported, invalid
from app.common.roles import Role
from app.weights.checkpoint import SAFETENSORS_TO_TORCH, Layout, safetensors_header

WORKERS = min(8, os.cpu_count() or 1)
"""Tensors rebuilt at once."""

__all__ = [
    "Change",
    "Delta",
    "Patch",
    "Staged",
    "check_base",
    "is_delta_file",
    "is_delta_folder",
    "one_file",
    "read_delta",
    "read_skyrl_delta",
    "stage",
    "state_checksums",
    "write_changes",
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
    role: Role
    """What it is to the request (named in every refusal)."""


BLOCK_BYTES = 4 << 20
"""A rebuilt tensor is checked and hashed a block at a time, each block while it is in cache."""
_EXPONENT: dict[torch.dtype, tuple[np.dtype[Any], int]] = {
    torch.float32: (np.dtype(np.uint32), 0x7F800000),
    torch.bfloat16: (np.dtype(np.uint16), 0x7F80),
    torch.float16: (np.dtype(np.uint16), 0x7C00),
    torch.float64: (np.dtype(np.uint64), 0x7FF0000000000000),
}
"""Per float dtype, its bits as an unsigned integer and its exponent's: all set is NaN or an
infinity."""


@dataclass(frozen=True)
class Patch:
    """A tensor's changed bytes: their positions (ascending) and new values. Applied by
    scattering them into the served tensor, which holds only its base until then."""

    positions: np.ndarray
    values: np.ndarray


Change = torch.Tensor | Patch
"""A staged tensor: rebuilt whole (an `xor` change), or the bytes to overwrite."""


@dataclass(frozen=True)
class Staged:
    """A delta rebuilt and checked: each changed tensor's change (`Change`), and the new
    tensors' checksums (`codec.DIGEST`)."""

    base_version: int
    changes: dict[str, Change]
    checksums: dict[str, str]
    num_bytes: int
    """The bytes of the tensors it changes."""
    compressed_bytes: int
    role: Role
    """What the delta is to the request (named in every refusal)."""


def is_delta_file(path: Path) -> bool:
    """A safetensors file whose metadata declares it a delta (`codec.META_KEY`)."""
    try:
        _, header = safetensors_header(path)
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


def read_delta(path: Path, role: Role) -> Delta:
    """The delta in file or folder `path`: its header and parts, read from the headers only.
    Refusals name `role`."""
    try:
        if path.is_dir():
            metadata = json.loads((path / codec.INDEX).read_text())["metadata"]
            files = sorted(path.glob("*.safetensors"))
        else:
            _, top = safetensors_header(path)
            metadata = json.loads((top.get("__metadata__") or {})[codec.META_KEY])
            files = [path]
        header = codec.header_of(metadata)
        parts: list[Part] = []
        for file in files:
            size, tensors = safetensors_header(file)
            sums = tensors.pop("__metadata__", None) or {}
            for name, info in tensors.items():
                begin, end = info["data_offsets"]
                if info.get("dtype") != "U8" or name not in sums:
                    raise ValueError(f"tensor '{name}' is not a compressed change with a checksum")
                encoding = header.encodings.get(name, header.encoding)
                parts.append(Part(name, file, 8 + size + begin, end - begin, sums[name], encoding))
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise Malformed(f"not a weight delta ({exc})", role=role) from None
    names = [p.name for p in parts]
    if len(set(names)) != len(names):
        raise Malformed("the delta names a tensor twice", role=role)
    _check_header(header, role)
    return Delta(header, tuple(parts), role)


SKYRL_MANIFEST = "manifest.json"


def read_skyrl_delta(folder: Path, role: Role) -> Delta:
    """A version SkyRL's `DeltaCheckpointPublisher` (0.4.0) published: `manifest.json` (its
    version, its base, per changed tensor the payload file and key, the xxh3-128 of the new
    tensor) and safetensors files of zstd-compressed XOR patches against the version before.
    Refusals name `role`."""
    try:
        manifest = json.loads((folder / SKYRL_MANIFEST).read_text())
        header = codec.DeltaHeader(
            base_version=int(manifest["base_version"]),
            version=int(manifest["version"]),
            encoding="xor",
            checksum_format=codec.DIGEST,
        )
        headers: dict[Path, tuple[int, dict[str, Any]]] = {}
        parts = []
        for record in manifest["tensors"]:
            algorithm = record.get("checksum_algorithm", codec.DIGEST)
            if algorithm != codec.DIGEST:
                raise Unsupported(
                    f"{folder.name} checks '{record['name']}' with {algorithm}, not {codec.DIGEST}",
                    role=role,
                )
            path = folder / Path(str(record["payload_file"])).name
            if path not in headers:
                headers[path] = safetensors_header(path)
            size, tensors = headers[path]
            begin, end = tensors[str(record["payload_key"])]["data_offsets"]
            parts.append(
                Part(
                    str(record["name"]),
                    path,
                    8 + size + begin,
                    end - begin,
                    record["checksum"],
                    "xor",
                )
            )
    except FileNotFoundError:
        raise NotFound(
            f"{folder} holds no published version (its manifest, written last, is not there)",
            role=role,
        ) from None
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise Malformed(f"{folder.name} is not a SkyRL delta ({exc!r})", role=role) from None
    return Delta(header, tuple(parts), role)


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


def _check_header(header: codec.DeltaHeader, role: Role) -> None:
    if header.compression_format != "zstd":
        raise Unsupported(
            f"compression '{header.compression_format}' (deltas are zstd-compressed)",
            role=role,
        )
    for encoding in {header.encoding, *header.encodings.values()}:
        if encoding not in codec.ENCODINGS:
            raise Unsupported(
                f"delta encoding '{encoding}' is not one of {list(codec.ENCODINGS)}",
                role=role,
            )
    if header.checksum_format not in codec.CHECKSUMS:
        raise Unsupported(
            f"checksum '{header.checksum_format}' is not one of {list(codec.CHECKSUMS)}",
            role=role,
        )
    try:
        codec.hasher(header.checksum_format)
    except ImportError:
        raise Unsupported(
            f"checksum '{header.checksum_format}' needs a package this server lacks",
            role=role,
        ) from None


def check_base(delta: Delta, served_version: int, served_digest: str | None) -> None:
    """Refuse a delta built on other weights than those served (by version, and by digest
    when the delta names its base's)."""
    header, role = delta.header, delta.role
    if header.base_version != served_version:
        raise Conflict(
            f"the delta builds on version {header.base_version}, but version "
            f"{served_version} is served: send the full weights, or a delta of them",
            role=role,
        )
    known = header.base_digest is not None and served_digest is not None
    if known and header.base_digest != served_digest:
        raise Conflict(
            f"the delta builds on weights with digest {header.base_digest}, but "
            f"those served have {served_digest}",
            role=role,
        )


def stage(
    delta: Delta, layout: Layout, served: Callable[[str], torch.Tensor], base_version: int
) -> Staged:
    """Rebuild every changed tensor from `served(name)` (the served tensor, only read), and
    check each against its checksum and for NaN or infinity; raises at the first problem,
    naming the tensor. An `overwrite` change stays a `Patch` (nothing of the tensor is
    copied); an `xor` change is rebuilt into a tensor of its own. Runs off the event loop,
    tensors side by side on the host's cores (zstd, numpy and xxhash let go of the GIL)."""
    for part in delta.parts:  # (refused before any work)
        if part.name not in layout:
            raise invalid(delta.role, f"unknown parameter '{part.name}' (not in the served model)")
        if layout[part.name][0] not in SAFETENSORS_TO_TORCH:
            raise Unsupported(f"'{part.name}' has dtype {layout[part.name][0]}", role=delta.role)
    with ThreadPoolExecutor(WORKERS) as pool:
        rebuilt = list(pool.map(lambda part: _rebuilt(delta, part, served), delta.parts))
    return Staged(
        base_version,
        {part.name: change for part, (change, _, _) in zip(delta.parts, rebuilt, strict=True)},
        {part.name: digest for part, (_, digest, _) in zip(delta.parts, rebuilt, strict=True)},
        sum(size for _, _, size in rebuilt),
        sum(part.size for part in delta.parts),
        delta.role,
    )


def _rebuilt(
    delta: Delta, part: Part, served: Callable[[str], torch.Tensor]
) -> tuple[Change, str, int]:
    """One tensor's change, checked: the change, the new tensor's checksum (`codec.DIGEST`)
    and its size."""
    role = delta.role
    base = served(part.name).detach()
    if base.device.type != "cpu" or not base.is_contiguous():
        base = base.to("cpu").contiguous()
    old = base.reshape(-1).view(torch.uint8).numpy()
    with part.path.open("rb") as f:
        f.seek(part.offset)
        frame = f.read(part.size)
    if len(frame) != part.size:
        raise Malformed(f"the delta is truncated at '{part.name}'", role=role)
    hashes = [codec.hasher(delta.header.checksum_format)]
    if delta.header.checksum_format != codec.DIGEST:
        hashes.append(codec.hasher(codec.DIGEST))
    exponent = _EXPONENT.get(base.dtype)
    try:
        if part.encoding == "overwrite":
            positions, values = codec.overwrites(frame, old.size)
            if positions.size > 1 and bool((positions[1:] < positions[:-1]).any()):
                order = np.argsort(positions, kind="stable")  # (a writer that did not sort)
                positions, values = positions[order], values[order]
            change: Change = Patch(positions, values)
            nonfinite = _patched(old, positions, values, hashes, exponent)
        else:
            payload = codec.xor_payload(frame, old.size)
            change = torch.empty_like(base)
            new = change.reshape(-1).view(torch.uint8).numpy()
            nonfinite = _xored(old, payload, new, hashes, exponent)
    except ValueError as exc:
        raise Malformed(f"tensor '{part.name}': {exc}", role=role) from None
    got = hashes[0].hexdigest()
    if got != part.checksum:
        raise Conflict(
            f"tensor '{part.name}' does not rebuild to its checksum (got {got}, the "
            f"delta says {part.checksum}): a corrupt delta, or another base than the served "
            "weights; nothing was applied",
            role=role,
        )
    if nonfinite:
        raise invalid(role, f"tensor '{part.name}' holds NaN or infinite values")
    return change, hashes[-1].hexdigest(), old.size


def _blocks(size: int) -> range:
    return range(0, size, BLOCK_BYTES)


def _patched(
    old: np.ndarray,
    positions: np.ndarray,
    values: np.ndarray,
    hashes: list[Any],
    exponent: tuple[np.dtype[Any], int] | None,
) -> bool:
    """Hash the tensor `old` would be with `values` at `positions`, block by block in a
    scratch buffer; whether a changed element is NaN or infinite (the others are served)."""
    scratch = np.empty(min(BLOCK_BYTES, old.size), dtype=np.uint8)
    bounds = np.searchsorted(positions, [*_blocks(old.size), old.size])
    nonfinite = False
    for i, start in enumerate(_blocks(old.size)):
        block = scratch[: min(BLOCK_BYTES, old.size - start)]
        np.copyto(block, old[start : start + block.size])
        inside = positions[bounds[i] : bounds[i + 1]] - start
        block[inside] = values[bounds[i] : bounds[i + 1]]
        nonfinite = nonfinite or touched_nonfinite(block, inside, exponent)
        for h in hashes:
            h.update(block)
    return nonfinite


def touched_nonfinite(
    block: np.ndarray, inside: np.ndarray, exponent: tuple[np.dtype[Any], int] | None
) -> bool:
    """Whether an element holding one of the bytes at `inside` of `block` is NaN or infinite
    (its exponent's bits all set); never for a dtype without one (`exponent` None)."""
    if exponent is None or not inside.size:
        return False
    bits, mask = exponent
    touched = block.view(bits)[inside // bits.itemsize]
    return bool(((touched & mask) == mask).any())


def _xored(
    old: np.ndarray,
    payload: np.ndarray,
    new: np.ndarray,
    hashes: list[Any],
    exponent: tuple[np.dtype[Any], int] | None,
) -> bool:
    """`new` = `old` XOR `payload`, hashed and checked block by block while in cache; whether
    any element is NaN or infinite."""
    nonfinite = False
    for start in _blocks(old.size):
        end = min(start + BLOCK_BYTES, old.size)
        block = new[start:end]
        np.bitwise_xor(old[start:end], payload[start:end], out=block)
        if exponent is not None:
            bits, mask = exponent
            nonfinite = nonfinite or bool(((block.view(bits) & mask) == mask).any())
        for h in hashes:
            h.update(block)
    return nonfinite


def write_changes(state: dict[str, torch.Tensor], changes: dict[str, Change]) -> None:
    """Write staged changes into the tensors of `state` (a model's, by checkpoint name),
    tensors side by side on the host's cores (a patch's scatter lets go of the GIL): the
    commit, under the serving pause."""
    items = [(state[name], change) for name, change in changes.items()]
    if len(items) > 1 and all(target.device.type == "cpu" for target, _ in items):
        with ThreadPoolExecutor(WORKERS) as pool:
            list(pool.map(lambda item: _write(*item), items))
        return
    for target, change in items:
        _write(target, change)


def _write(target: torch.Tensor, change: Change) -> None:
    with torch.no_grad():  # (per thread)
        if isinstance(change, torch.Tensor):
            target.copy_(change)
            return
        whole = target if target.is_contiguous() else target.contiguous()  # (a view's copy)
        flat = whole.view(-1).view(torch.uint8)
        if flat.device.type == "cpu":
            flat.numpy()[change.positions] = change.values
        else:
            at = torch.from_numpy(change.positions.astype(np.int64)).to(flat.device)
            flat[at] = torch.from_numpy(np.ascontiguousarray(change.values)).to(flat.device)
        if whole is not target:
            target.copy_(whole)


def state_checksums(
    state: dict[str, torch.Tensor],
    names: Iterable[str] | None = None,
    known: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The checksums of a model's `state` tensors (`codec.tensor_checksum`): all of them, or
    those of `names` and every name tied to one of them (a write under one name is a write
    under every name of the same memory), taking the `known` checksums as they are."""
    if names is None:
        return {name: codec.tensor_checksum(t) for name, t in state.items()}
    known = known or {}
    written = {_memory(state[n]): known.get(n) for n in names if n in state}
    out: dict[str, str] = {}
    for name, tensor in state.items():
        memory = _memory(tensor)
        if memory in written:
            checksum = written[memory] or codec.tensor_checksum(tensor)
            out[name] = written[memory] = checksum
    return out


def _memory(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    return tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()), tuple(tensor.shape)
