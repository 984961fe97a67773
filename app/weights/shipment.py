"""A checkpoint on its way to other servers: each file as chunks of bounded size, each chunk a
handle its receiver fetches (a Ray object, or the bytes themselves in one process), so that
neither side ever holds more than a chunk of it in memory."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from app.common.roles import Role
from app.weights.checkpoint import read_chunks

CHUNK_BYTES = 16 << 20


class Chunk(Protocol):
    async def fetch(self) -> bytes:
        """The chunk's bytes (read from wherever the sender left them)."""
        ...


Put = Callable[[bytes], Chunk]
"""Leaves a chunk where receivers can fetch it."""


@dataclass(frozen=True)
class Held:
    """A chunk carried by value (in one process)."""

    data: bytes

    async def fetch(self) -> bytes:
        return self.data


@dataclass(frozen=True)
class ShippedFile:
    name: str
    size: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Shipment:
    """A checkpoint's files, each in order of its chunks."""

    files: tuple[ShippedFile, ...]

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)

    async def whole(self) -> dict[str, bytes]:
        """Every file's bytes by name, in memory (small checkpoints, merging)."""
        return {f.name: b"".join([await c.fetch() for c in f.chunks]) for f in self.files}


def ship(
    files: Mapping[str, Path], put: Put, role: Role, chunk_bytes: int = CHUNK_BYTES
) -> Shipment:
    """`files` (by the name they travel under) read chunk by chunk into `put`; refused (409)
    when one changed while it was read, as `app.weights.checkpoint.snapshot` refuses it."""
    shipped = []
    for name, path in files.items():
        chunks, size = [], 0
        for data in read_chunks(path, role, chunk_bytes):
            chunks.append(put(data))
            size += len(data)
        shipped.append(ShippedFile(name, size, tuple(chunks)))
    return Shipment(tuple(shipped))


def ship_bytes(files: Mapping[str, bytes], put: Put, chunk_bytes: int = CHUNK_BYTES) -> Shipment:
    """Files already in memory, cut into chunks."""
    return Shipment(
        tuple(
            ShippedFile(
                name,
                len(data),
                tuple(put(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)),
            )
            for name, data in files.items()
        )
    )
