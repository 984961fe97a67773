"""Safetensors checkpoints: read their layout, check it against a model's, iterate tensors."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open

from app.common.failures import Conflict, Malformed, NotFound, TimedOut, file_failure, invalid
from app.common.roles import Role

# (safetensors dtype name, shape)
Layout = dict[str, tuple[str, tuple[int, ...]]]
T = TypeVar("T")

TORCH_TO_SAFETENSORS = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


SAFETENSORS_TO_TORCH = {name: dtype for dtype, name in TORCH_TO_SAFETENSORS.items()}


def layout_of_state(state: dict[str, torch.Tensor]) -> Layout:
    return {
        name: (TORCH_TO_SAFETENSORS.get(t.dtype, str(t.dtype)), tuple(t.shape))
        for name, t in state.items()
    }


def to_safetensors(state: dict[str, torch.Tensor]) -> bytes:
    """`state` as one safetensors file, each tensor copied once, straight from its device into
    the file's buffer (tensors that share memory, views into one received bucket say, need no
    copies of their own first, as safetensors' own writer would)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        dtype = TORCH_TO_SAFETENSORS[tensor.dtype]
        header[name] = {
            "dtype": dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    start = 8 + len(text)
    out = bytearray(start + offset)
    out[:start] = len(text).to_bytes(8, "little") + text
    data = torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)
    for name, tensor in state.items():
        first, last = header[name]["data_offsets"]
        if last > first:
            data[start + first : start + last].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    return bytes(out)


async def file_work(
    work: Callable[..., T], *args: Any, timeout_s: float, role: Role = Role.CHECKPOINT
) -> T:
    """Checkpoint file work in a thread, bounded in time: a file that blocks (a FIFO, a hung
    network mount) costs a 504, never the event loop; a file call that fails on the path the
    request named (as `role`) is its failure, named (`file_failure`)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await asyncio.to_thread(work, *args)
    except TimeoutError:
        raise TimedOut(f"reading the checkpoint took over {timeout_s:g} s") from None
    except OSError as error:
        raise file_failure(error, role) from None


def checkpoint_files(directory: Path, role: Role = Role.CHECKPOINT) -> list[Path]:
    """The `*.safetensors` files of an HF checkpoint directory (or a single file). Only
    regular files: a FIFO or device named like a checkpoint would block the reader forever."""
    if not directory.exists():
        raise NotFound(f"{directory} does not exist on the server", role=role)
    files = [directory] if not directory.is_dir() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise NotFound(f"{directory} holds no .safetensors files", role=role)
    for path in files:
        if not stat.S_ISREG(path.stat().st_mode):
            raise invalid(role, f"{path} is not a regular file")
    return files


def snapshot(files: list[Path], into: Path, role: Role) -> list[Path]:
    """Private copies of `files` in `into`, each refused (409) when the original changed while
    it was copied (size, mtime, ctime or inode moved): a load then applies what one version
    of the checkpoint held, or nothing. No copy is left behind on failure."""
    copies: list[Path] = []
    try:
        for path in files:
            before = _signature(path)
            handle, name = tempfile.mkstemp(dir=into, suffix=".safetensors")
            copies.append(Path(name))
            with path.open("rb") as source, os.fdopen(handle, "wb") as target:
                shutil.copyfileobj(source, target, 8 << 20)
                copied = target.tell()
            _unchanged(path, before, copied, role)
    except BaseException:
        for copy in copies:
            copy.unlink(missing_ok=True)
        raise
    return copies


def read_chunks(path: Path, role: Role, chunk_bytes: int) -> Iterator[bytes]:
    """The file's bytes in chunks of `chunk_bytes` (the last may be shorter), refused (409) at
    the end as `snapshot` refuses a file that changed while it was read: what one version of
    the checkpoint held."""
    before = _signature(path)
    size = 0
    with path.open("rb") as source:
        while data := source.read(chunk_bytes):
            size += len(data)
            yield data
    _unchanged(path, before, size, role)


def _unchanged(path: Path, before: tuple[int, ...], copied: int, role: Role) -> None:
    if _signature(path) != before or copied != before[2]:
        raise Conflict(
            f"{path.name} changed while it was read; load it again once it is completely written",
            role=role,
        )


def _signature(path: Path) -> tuple[int, ...]:
    info = path.stat()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def read_layout(files: list[Path], role: Role) -> Layout:
    """Names, dtypes and shapes, read from the headers only; 400 for corrupt or truncated files."""
    layout: Layout = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensor_slice = f.get_slice(name)
                    layout[name] = (tensor_slice.get_dtype(), tuple(tensor_slice.get_shape()))
        except PermissionError as exc:
            raise invalid(role, f"{path} is not readable by the server ({exc})") from exc
        except (OSError, ValueError, json.JSONDecodeError, Exception) as exc:
            raise Malformed(
                f"{path.name} is not a valid safetensors file ({exc})",
                role=role,
            ) from exc
    if not layout:
        raise Malformed("the checkpoint holds no tensors", role=role)
    return layout


def check_layout(update: Layout, model: Layout) -> None:
    """Every tensor must name a model parameter with the same shape and dtype (subsets allowed)."""
    for name, (dtype, shape) in update.items():
        if name not in model:
            raise invalid(Role.TENSORS, f"unknown parameter '{name}' (not in the served model)")
        want_dtype, want_shape = model[name]
        if shape != want_shape:
            raise invalid(
                Role.TENSORS, f"'{name}' has shape {list(shape)}, the model's is {list(want_shape)}"
            )
        if dtype != want_dtype:
            raise invalid(Role.TENSORS, f"'{name}' has dtype {dtype}, the model's is {want_dtype}")


def safetensors_header(path: Path) -> tuple[int, dict[str, Any]]:
    """A safetensors file's header (with its `__metadata__`) and the header's size in bytes
    (a tensor's data starts at 8 + size + its first offset). ValueError past 100 MiB."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if size > 100 << 20:
            raise ValueError(f"a header of {size} bytes")
        header: dict[str, Any] = json.loads(f.read(size))
    return size, header


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    size, header = safetensors_header(path)
    header.pop("__metadata__", None)
    return size, header


def copy_into(state: dict[str, torch.Tensor], files: list[Path]) -> None:
    """Copy every tensor of (already checked) files into `state`."""
    for name, _, data in _tensor_bytes(files):
        target = state[name]
        with torch.no_grad():
            target.copy_(data.view(target.dtype).view(target.shape))


def file_checksums(files: list[Path]) -> dict[str, str]:
    """Each tensor's checksum (`rlserve_client.weight_delta.DIGEST`) of its bytes."""
    from rlserve_client.weight_delta import checksum

    return {name: checksum(data.numpy()) for name, _, data in _tensor_bytes(files)}


def check_finite(files: list[Path], role: Role) -> None:
    """Refuse NaN and infinities in floating-point tensors."""
    for name, dtype, data in _tensor_bytes(files):
        torch_dtype = SAFETENSORS_TO_TORCH.get(dtype)
        if torch_dtype is None or not torch_dtype.is_floating_point:
            continue
        if not bool(torch.isfinite(data.view(torch_dtype)).all()):
            raise invalid(role, f"tensor '{name}' holds NaN or infinite values")


def _tensor_bytes(files: list[Path]) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(name, safetensors dtype, raw bytes) of every non-empty tensor, read through one reused
    staging buffer per file with plain file reads: memory grows by the largest tensor only,
    not by the payload (no mmap, no per-tensor allocations left behind). Each byte tensor is
    valid until the next one is read."""
    for path in files:
        header_size, header = _header(path)
        spans = sorted(
            (meta["data_offsets"][0], meta["data_offsets"][1], name, meta["dtype"])
            for name, meta in header.items()
        )
        largest = max(end - begin for begin, end, _, _ in spans)
        staging = torch.empty(largest, dtype=torch.uint8)
        with path.open("rb", buffering=0) as f:
            for begin, end, name, dtype in spans:
                if end == begin:
                    continue
                f.seek(8 + header_size + begin)
                data = staging[: end - begin]
                _read_exactly(f, memoryview(data.numpy()))  # type: ignore[arg-type]
                yield name, dtype, data


def _read_exactly(f: Any, buffer: memoryview) -> None:
    filled = 0
    while filled < len(buffer):
        count = f.readinto(buffer[filled:])
        if not count:
            raise OSError("unexpected end of file")
        filled += count


def write_and_flush(sink: Any, chunks: list[bytes]) -> None:
    """Write `chunks` to the open file `sink` and flush it (blocking: call in a thread)."""
    sink.writelines(chunks)
    sink.flush()
