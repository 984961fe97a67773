"""A vLLM trainer's side of a weight transfer on the CPU: vLLM's stateless gloo group (rank 0,
the store under the `tcp://` URI, as `stateless_init_torch_distributed_process_group` opens
it) and its broadcasts, one per tensor or packed as `pack_tensors` cuts them. On a GPU, vLLM's
NCCL trainer engine sends the same buckets over NCCL; trainers' own clients (TRL, SkyRL) drive
the HTTP side in the tests that use this."""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

TIMEOUT = datetime.timedelta(seconds=60)
DEFAULT_PACKED_BYTES = 1 << 30
"""vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES."""


def gloo_group(address: str, port: int, world_size: int) -> Any:
    """vLLM's `stateless_init_torch_distributed_process_group(..., backend="gloo")` at rank 0:
    torch's tcp:// rendezvous, the store under that URI, a bare gloo group."""
    uri = f"tcp://{address}:{port}"
    store, _, _ = next(c10d.rendezvous(uri, 0, world_size, timeout=TIMEOUT))
    return dist.ProcessGroupGloo(dist.PrefixStore(uri, store), 0, world_size, TIMEOUT)


def packed_chunks(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[torch.Tensor]:
    """vLLM's `pack_tensors`: bytes back to back until a chunk passes `limit`."""
    chunks, current, size = [], [], 0
    for _, tensor in tensors:
        data = tensor.contiguous().view(-1).view(torch.uint8)
        current.append(data)
        size += data.numel()
        if size > limit:
            chunks.append(torch.cat(current))
            current, size = [], 0
    return [*chunks, torch.cat(current)] if current else chunks


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send(
    group: Any,
    tensors: list[tuple[str, torch.Tensor]],
    packed: bool,
    limit: int = DEFAULT_PACKED_BYTES,
) -> None:
    """The trainer's broadcasts of `tensors`: packed buckets of `limit`, or one per tensor."""
    payloads = packed_chunks(tensors, limit) if packed else [t for _, t in tensors]
    for payload in payloads:
        broadcast(group, payload.contiguous())
