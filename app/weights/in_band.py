"""Weights whose names, dtypes and shapes travel over the group itself, as prime-rl's trainer
broadcasts them (its NCCL weight broadcast, `src/prime_rl/transports/weights/nccl.py` at
559b4477): an int64 count of chunks; per chunk an int64 length, that many bytes of a pickled
`{dtype: [(name, shape, numel), ...]}`, then per dtype, in that order, one flat tensor of that
dtype holding the chunk's tensors of it back to back.

The pickle is read allowing torch's dtypes and sizes alone: never code, whatever the bytes
say. Each tensor must be one of the served model's, with its shape and dtype, before its bytes
are received (an unknown one fails the update at once: nothing is allocated for it)."""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import torch

from app.common.failures import InvalidInput, invalid
from app.common.roles import Role
from app.weights.checkpoint import TORCH_TO_SAFETENSORS, Layout, check_layout

Receive = Callable[[torch.Tensor], Callable[[], None]]
"""Starts filling a buffer with the trainer's next broadcast; the returned call waits until it
is full."""
MAX_CHUNKS = 1 << 20
MAX_METADATA_BYTES = 64 << 20
MAX_NUMEL = 1 << 40


class _Metadata(pickle.Unpickler):
    """An unpickler of a chunk's metadata: dicts, lists, tuples, strings and numbers, torch's
    dtypes and `torch.Size`; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise invalid(
            Role.TENSORS,
            f"the update's metadata names {module}.{name}; only torch's dtypes and sizes may "
            "travel with the weights",
        )


def read_metadata(raw: bytes) -> list[tuple[torch.dtype, list[tuple[str, tuple[int, ...]]]]]:
    """A chunk's metadata, checked: per dtype, its tensors' names and shapes, in order."""
    try:
        metadata = _Metadata(io.BytesIO(raw)).load()
    except InvalidInput:
        raise
    except Exception as exc:
        raise invalid(Role.TENSORS, f"the update's metadata is not readable: {exc}") from exc
    if not isinstance(metadata, dict):
        raise invalid(Role.TENSORS, "the update's metadata is not a mapping of dtypes")
    groups = []
    for dtype, items in metadata.items():
        if not isinstance(dtype, torch.dtype) or not isinstance(items, list):
            raise invalid(Role.TENSORS, "the update's metadata maps dtypes to lists of tensors")
        tensors = []
        for item in items:
            if not (isinstance(item, tuple | list) and len(item) == 3):
                raise invalid(Role.TENSORS, "each tensor of the metadata is (name, shape, numel)")
            name, shape, numel = item
            dims = tuple(shape) if isinstance(shape, tuple | list) else None
            if (
                not isinstance(name, str)
                or dims is None
                or not all(isinstance(d, int) and d >= 0 for d in dims)
                or not isinstance(numel, int)
                or numel != math.prod(dims)
                or numel > MAX_NUMEL
            ):
                raise invalid(Role.TENSORS, f"tensor {name!r} of the metadata is malformed")
            tensors.append((name, dims))
        groups.append((dtype, tensors))
    return groups


def receive_in_band(
    receive: Receive, device: torch.device, stage: torch.device, expected: Layout | None
) -> dict[str, torch.Tensor]:
    """Receive one update in prime-rl's format; the tensors, by name (moved to `stage`)."""
    staged: dict[str, torch.Tensor] = {}
    count = _integer(receive, device)
    if not 0 <= count <= MAX_CHUNKS:
        raise invalid(Role.TENSORS, f"the update announces {count} chunks")
    for _ in range(count):
        length = _integer(receive, device)
        if not 0 < length <= MAX_METADATA_BYTES:
            raise invalid(Role.TENSORS, f"a chunk's metadata of {length} bytes")
        raw = _received(receive, length, device).cpu().numpy().tobytes()
        for dtype, tensors in read_metadata(raw):
            for name, shape in tensors:
                _check(name, dtype, shape, expected, staged)
            sizes = [math.prod(shape) * dtype.itemsize for _, shape in tensors]
            flat = _received(receive, sum(sizes), device).to(stage)
            offset = 0
            for (name, shape), size in zip(tensors, sizes, strict=True):
                data = flat[offset : offset + size]
                if offset % dtype.itemsize:  # (a neighbour of an odd size: realign)
                    data = data.clone()
                staged[name] = data.view(dtype).view(shape)
                offset += size
    return staged


def _check(
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    expected: Layout | None,
    staged: dict[str, torch.Tensor],
) -> None:
    if name in staged:
        raise invalid(Role.TENSORS, f"tensor '{name}' is sent twice in one update")
    if dtype not in TORCH_TO_SAFETENSORS:
        raise invalid(Role.TENSORS, f"tensor '{name}' has dtype {dtype}, which is not served")
    if expected is not None:
        check_layout({name: (TORCH_TO_SAFETENSORS[dtype], shape)}, expected)


def _integer(receive: Receive, device: torch.device) -> int:
    """One int64 the trainer broadcasts (a count or a length)."""
    return int(_received(receive, 8, device).cpu().view(torch.int64).item())


def _received(receive: Receive, nbytes: int, device: torch.device) -> torch.Tensor:
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    receive(buffer)()
    return buffer
