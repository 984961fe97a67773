"""The server's member of the weight-transfer collective (the protocol both sides share is
`rlserve_client.collective`): it joins the trainer's rendezvous at its rank and receives
each bucket into a buffer."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from rlserve_client.collective import (
    STORE_PREFIX,
    Transport,
    broadcast_slices,
    process_group,
    wait_all,
    warm_up,
)

__all__ = ["Rendezvous", "TransferGroup", "Transport"]


@dataclass(frozen=True)
class Rendezvous:
    """Where and how to join: the trainer's store, this process's rank, the group's shape."""

    transport: Transport
    address: str
    port: int
    rank: int
    world_size: int
    timeout_s: float
    streams: int = 4


class TransferGroup:
    """A joined group; `receive` fills a buffer from rank 0 (the trainer)."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
        store = dist.TCPStore(
            rendezvous.address,
            rendezvous.port,
            rendezvous.world_size,
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        self.group: Any = process_group(
            rendezvous.transport,
            prefixed,
            rendezvous.rank,
            rendezvous.world_size,
            rendezvous.timeout_s,
        )
        self._store = store
        self.rendezvous = rendezvous
        self.device = device
        warm_up(self.group, device, rendezvous.streams, rendezvous.timeout_s)

    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        """Start filling `buffer` (1-D bytes) with rank 0's next bucket; the returned call
        waits for it (raising on timeout or a lost peer). Buckets arrive in call order."""
        works = broadcast_slices(self.group, buffer, self.rendezvous.streams)
        return lambda: wait_all(works, self.rendezvous.timeout_s)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        del self.group, self._store
