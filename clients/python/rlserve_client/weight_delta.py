"""Weight deltas and digests: what a trainer and the server must agree on, bit for bit (needs
the `[torch]` extra; the server has it).

A delta carries, per changed tensor, the change from the base version's raw bytes to the new
version's, compressed with zstd, and a checksum of the new bytes. Two encodings, both blind to
the dtype (they work on bytes):

- `xor`: the new bytes XOR the old. Unchanged bytes are zeros, which zstd crushes; applying it
  twice undoes it, so it applies once, on its exact base.
- `overwrite`: the count of changed bytes (uint32, little-endian), their positions (uint32
  each), then their new values. Smaller when few bytes changed; applying it again is harmless.

This is slime's on-disk delta format (its `weight_v{N:06d}` version folders: each file a
safetensors file of compressed uint8 tensors whose metadata maps a tensor's name to its
checksum; the folder's `model.safetensors.index.json` metadata names `version`,
`base_version`, `delta_encoding`, `compression_format` and `checksum_format`). A delta sent in
one file (rlserve's `PUT /v1/weights`) carries that metadata under `META_KEY` in the file's own
metadata, with `encodings` naming each tensor's where the encoder picked per tensor.

A version's digest is the checksum of its tensors' checksums, sorted by name: a trainer
computes it from its own tensors (in the served dtype) with `weights_digest` and compares it
with the one the server reports."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

Encoding = Literal["xor", "overwrite"]
ENCODINGS: tuple[str, ...] = ("xor", "overwrite")
CHECKSUMS: tuple[str, ...] = ("xxh3-128", "blake3", "adler32")
DIGEST = "xxh3-128"
"""The checksum a digest is made of (and the one `DeltaEncoder` writes by default)."""
META_KEY = "rlserve.delta"
TRANSFER_NAME = META_KEY
"""The name of the one uint8 tensor a delta travels as over the collective transfer."""
INDEX = "model.safetensors.index.json"
ZSTD_LEVEL = 1  # slime's choice: level 1 beats the others on size and speed for this data
_MAX_POSITIONS = 2**32 - 1  # `overwrite` stores positions as uint32


class _Adler32:
    def __init__(self) -> None:
        self._value = 1

    def update(self, data: Any) -> None:
        self._value = zlib.adler32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def hasher(algorithm: str) -> Any:
    """A fresh incremental hash (`update`, `hexdigest`) of `algorithm` (one of CHECKSUMS)."""
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake3":
        import blake3  # optional: only its users need it

        return blake3.blake3()
    if algorithm == "adler32":
        return _Adler32()
    raise ValueError(f"checksum: '{algorithm}' is not one of {list(CHECKSUMS)}")


def checksum(data: Any, algorithm: str = DIGEST) -> str:
    """The hex checksum of a buffer's bytes."""
    h = hasher(algorithm)
    h.update(data)
    return str(h.hexdigest())


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array (a view when it is on the CPU and contiguous)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_checksum(tensor: torch.Tensor, algorithm: str = DIGEST) -> str:
    return checksum(raw_bytes(tensor), algorithm)


def digest(checksums: Mapping[str, str]) -> str:
    """A version's digest from its tensors' checksums."""
    h = hasher(DIGEST)
    for name in sorted(checksums):
        h.update(f"{name}\t{checksums[name]}\n".encode())
    return f"{DIGEST}:{h.hexdigest()}"


def weights_digest(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """The digest of `state` (a model's `state_dict()`, every tensor the server serves), each
    tensor cast to `dtype` first when given (the served dtype, for a trainer in another)."""
    return digest(
        {
            name: tensor_checksum(t.to(dtype) if dtype is not None and t.is_floating_point() else t)
            for name, t in state.items()
        }
    )


# -- one tensor ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One tensor's change: its encoding, the zstd frame, and how many bytes changed."""

    encoding: str
    frame: bytes
    changed: int


def encode(new: np.ndarray, old: np.ndarray, encoding: str) -> Change | None:
    """The change from `old` to `new` (flat uint8 arrays of one size); None when no byte
    changed. `encoding` "auto" picks `overwrite` when it is a quarter of the tensor or less
    before compression (few changed bytes), else `xor`."""
    import zstandard

    if new.shape != old.shape:
        raise ValueError(f"a tensor's size changed ({old.size} bytes to {new.size})")
    changed_mask = new != old
    changed = int(np.count_nonzero(changed_mask))
    if changed == 0:
        return None
    if encoding == "auto":
        fits = new.size <= _MAX_POSITIONS
        encoding = "overwrite" if fits and 4 + 5 * changed <= new.size // 4 else "xor"
    if encoding == "xor":
        payload = np.bitwise_xor(new, old)
    elif encoding == "overwrite":
        if new.size > _MAX_POSITIONS:
            raise ValueError("overwrite positions are uint32: a tensor over 4 GiB takes xor")
        positions = np.flatnonzero(changed_mask).astype("<u4")
        count = np.array([positions.size], "<u4")
        payload = np.concatenate(
            [count.view(np.uint8), positions.view(np.uint8), new[changed_mask]]
        )
    else:
        raise ValueError(f"encoding: '{encoding}' is not one of {list(ENCODINGS)}")
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload.tobytes())
    return Change(encoding, frame, changed)


def _decompressed(frame: bytes | memoryview, limit: int) -> np.ndarray:
    """A zstd frame's content, refused past `limit` bytes: allocated at its declared size when
    the frame declares one (zstandard's `compress` does), read in pieces otherwise."""
    import zstandard

    frame = bytes(frame)
    try:
        declared = zstandard.frame_content_size(frame)
        if 0 <= declared <= limit:
            data = zstandard.ZstdDecompressor().decompress(frame)
        elif declared > limit:
            raise ValueError(f"the change is larger than its tensor's bytes allow ({limit})")
        else:
            reader = zstandard.ZstdDecompressor().stream_reader(frame)
            pieces, size = [], 0
            while size <= limit and (piece := reader.read(min(1 << 24, limit + 1 - size))):
                pieces.append(piece)
                size += len(piece)
            data = b"".join(pieces)
    except zstandard.ZstdError as exc:
        raise ValueError(f"not a zstd frame ({exc})") from None
    if len(data) > limit:
        raise ValueError(f"the change is larger than its tensor's bytes allow ({limit})")
    return np.frombuffer(data, dtype=np.uint8)


def xor_payload(frame: bytes | memoryview, size: int) -> np.ndarray:
    """An `xor` change of a tensor of `size` bytes: `size` bytes to XOR onto it. Raises
    ValueError for anything else (never decompressing more than `size` + 1 bytes)."""
    payload = _decompressed(frame, size)
    if payload.size != size:
        raise ValueError(f"the change has {payload.size} bytes for a tensor of {size}")
    return payload


def overwrites(frame: bytes | memoryview, size: int) -> tuple[np.ndarray, np.ndarray]:
    """An `overwrite` change of a tensor of `size` bytes: the positions (uint32) and their new
    bytes. Raises ValueError for anything else."""
    payload = _decompressed(frame, 4 + 5 * size)
    if payload.size < 4:
        raise ValueError("the change is shorter than its count")
    count = int(payload[:4].view("<u4")[0])
    if payload.size != 4 + 5 * count:
        raise ValueError(f"the change has {payload.size} bytes for {count} positions")
    positions = payload[4 : 4 + 4 * count].view("<u4")
    if count and int(positions.max()) >= size:
        raise ValueError(f"a position is past the tensor's {size} bytes")
    return positions, payload[4 + 4 * count :]


def apply(region: np.ndarray, compressed: bytes | memoryview, encoding: str) -> None:
    """Apply one tensor's change to `region` (its base bytes, flat uint8, written in place).
    Raises ValueError when the change does not fit the region (a corrupt or foreign delta)."""
    if encoding == "xor":
        np.bitwise_xor(region, xor_payload(compressed, region.size), out=region)
    elif encoding == "overwrite":
        positions, values = overwrites(compressed, region.size)
        region[positions] = values
    else:
        raise ValueError(f"encoding: '{encoding}' is not one of {list(ENCODINGS)}")


# -- one version -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaHeader:
    """What a delta says of itself (slime's index metadata, and rlserve's additions)."""

    base_version: int
    version: int | None = None
    """The version it makes (None: the server's next)."""
    encoding: str = "xor"
    """The default encoding (`encodings` names each tensor's where it differs)."""
    checksum_format: str = DIGEST
    compression_format: str = "zstd"
    base_digest: str | None = None
    """The base's digest, when the sender knows it: checked before anything is applied."""
    encodings: dict[str, str] = field(default_factory=dict)

    def metadata(self) -> dict[str, str]:
        meta = {
            "base_version": str(self.base_version),
            "delta_encoding": self.encoding,
            "compression_format": self.compression_format,
            "checksum_format": self.checksum_format,
        }
        if self.version is not None:
            meta["version"] = str(self.version)
        if self.base_digest is not None:
            meta["base_digest"] = self.base_digest
        if self.encodings:
            meta["encodings"] = json.dumps(self.encodings, sort_keys=True)
        return meta


@dataclass
class Encoded:
    """One version's delta, ready to send: `blob` is a safetensors file."""

    blob: bytes
    header: DeltaHeader
    changed: dict[str, int]
    """Changed bytes per changed tensor."""
    total_bytes: int
    """The bytes of every tensor compared (what a full push sends, less its header)."""

    @property
    def changed_share(self) -> float:
        return sum(self.changed.values()) / max(self.total_bytes, 1)


def encode_state(
    new: Mapping[str, np.ndarray],
    old: Mapping[str, np.ndarray],
    header: DeltaHeader,
    *,
    encoding: str = "auto",
    workers: int = 2,
) -> Encoded:
    """The delta from `old` to `new` (flat uint8 arrays by name; every name of `new` must be
    in `old`) as one safetensors file with the checksums of the new bytes."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.numpy import save

    missing = sorted(set(new) - set(old))
    if missing:
        raise KeyError(f"no base for tensors {missing[:5]}")

    def one(name: str) -> tuple[str, Change | None, str]:
        change = encode(new[name], old[name], encoding)
        return name, change, checksum(new[name], header.checksum_format) if change else ""

    tensors: dict[str, np.ndarray] = {}
    sums: dict[str, str] = {}
    encodings: dict[str, str] = {}
    changed: dict[str, int] = {}
    with ThreadPoolExecutor(max(1, workers)) as pool:  # zstd, numpy and xxhash free the GIL
        for name, change, new_checksum in pool.map(one, sorted(new)):
            if change is None:
                continue
            tensors[name] = np.frombuffer(change.frame, dtype=np.uint8)
            sums[name] = new_checksum
            changed[name] = change.changed
            if change.encoding != header.encoding:
                encodings[name] = change.encoding
    header = DeltaHeader(**{**header.__dict__, "encodings": encodings})
    metadata = {**sums, META_KEY: json.dumps(header.metadata(), sort_keys=True)}
    total = sum(int(a.size) for a in new.values())
    return Encoded(save(tensors, metadata=metadata), header, changed, total)


def header_of(metadata: Mapping[str, str], where: str = "delta") -> DeltaHeader:
    """A delta's header from its metadata (slime's index metadata, or `META_KEY`'s JSON).
    Raises ValueError naming what is wrong."""
    try:
        encodings = json.loads(metadata.get("encodings", "{}"))
        version = metadata.get("version")
        return DeltaHeader(
            base_version=int(metadata["base_version"]),
            version=int(version) if version is not None else None,
            encoding=str(metadata["delta_encoding"]),
            checksum_format=str(metadata.get("checksum_format", DIGEST)),
            compression_format=str(metadata.get("compression_format", "zstd")),
            base_digest=metadata.get("base_digest"),
            encodings={str(k): str(v) for k, v in dict(encodings).items()},
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{where}: its metadata is not a delta's ({exc!r})") from None


class DeltaEncoder:
    """Keeps the last state pushed (the server's base) and encodes the next as a delta of it.
    `state` values are tensors in the served dtype; the encoder keeps its own copies."""

    def __init__(self, *, encoding: str = "auto", checksum_format: str = DIGEST) -> None:
        self.encoding = encoding
        self.checksum_format = checksum_format
        self.base: dict[str, np.ndarray] = {}
        self.base_version: int | None = None
        self.base_digest: str | None = None

    def covers(self, names: Iterable[str]) -> bool:
        return self.base_version is not None and all(n in self.base for n in names)

    def encode(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> Encoded:
        if self.base_version is None:
            raise ValueError("no base yet: push the full weights first")
        header = DeltaHeader(
            base_version=self.base_version,
            version=version,
            encoding="xor" if self.encoding == "auto" else self.encoding,
            checksum_format=self.checksum_format,
            base_digest=self.base_digest,
        )
        new = {name: raw_bytes(t) for name, t in state.items()}
        return encode_state(new, self.base, header, encoding=self.encoding)

    def remember(
        self, state: Mapping[str, torch.Tensor], version: int, served_digest: str | None
    ) -> None:
        """`state` is what the server now serves as `version` (its digest `served_digest`)."""
        for name, t in state.items():
            self.base[name] = raw_bytes(t).copy()
        self.base_version = version
        self.base_digest = served_digest
