"""The server's member of the weight-transfer collective: it joins the trainer's rendezvous at
its rank and receives each bucket into a buffer.

Three rendezvous, one per protocol a trainer may speak (the trainer is rank 0 and hosts the
`TCPStore` in each):
- "rlserve": rlserve's own (`rlserve_client.collective`): a bare group over the store under
  STORE_PREFIX, a warm-up broadcast, each bucket broadcast as `streams` slices.
- "vllm": vLLM's stateless groups, as a vLLM trainer opens them: over gloo the group of
  `vllm.distributed.utils.stateless_init_torch_distributed_process_group` (the store under the
  `tcp://host:port` prefix); over NCCL vLLM's own `StatelessProcessGroup` and
  `PyNcclCommunicator` (needs vllm installed). One broadcast per bucket, no warm-up.
- "torch": torch.distributed's `init_process_group` recipe with a group name, as SGLang's
  `init_custom_process_group` (and the trainers that drive SGLang: slime, AReaL) open it: the
  store under the group name, torch's own process-group factory. One broadcast per bucket."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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

__all__ = ["Rendezvous", "RendezvousStyle", "TransferGroup", "Transport"]

RendezvousStyle = Literal["rlserve", "vllm", "torch"]


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
    style: RendezvousStyle = "rlserve"
    group_name: str = ""
    """The "torch" style's group name (its store prefix)."""

    @property
    def tcp_uri(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"


class TransferGroup:
    """A joined group; `receive` fills a buffer from rank 0 (the trainer)."""

    def __init__(self, rendezvous: Rendezvous, device: torch.device) -> None:
        self.rendezvous = rendezvous
        self.device = device
        self._store: Any = None
        self._nccl: Any = None
        if rendezvous.style == "rlserve":
            self._store = _store(rendezvous, wait_for_workers=False)
            prefixed = dist.PrefixStore(STORE_PREFIX, self._store)
            self.group: Any = process_group(
                rendezvous.transport,
                prefixed,
                rendezvous.rank,
                rendezvous.world_size,
                rendezvous.timeout_s,
            )
            warm_up(self.group, device, rendezvous.streams, rendezvous.timeout_s)
        elif rendezvous.style == "vllm" and rendezvous.transport == "nccl":
            self.group = None
            self._nccl = _vllm_nccl(rendezvous, device)
        elif rendezvous.style == "vllm":
            # The store counts its workers: a trainer's master waits until all joined.
            self._store = _store(rendezvous, wait_for_workers=True)
            prefixed = dist.PrefixStore(rendezvous.tcp_uri, self._store)
            self.group = process_group(
                "gloo", prefixed, rendezvous.rank, rendezvous.world_size, rendezvous.timeout_s
            )
        else:
            self.group = _torch_group(rendezvous)

    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        """Start filling `buffer` (1-D bytes) with rank 0's next bucket; the returned call
        waits for it (raising on timeout or a lost peer). Buckets arrive in call order."""
        if self._nccl is not None:
            self._nccl.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
            return torch.cuda.current_stream().synchronize
        streams = self.rendezvous.streams if self.rendezvous.style == "rlserve" else 1
        works = broadcast_slices(self.group, buffer, streams)
        return lambda: wait_all(works, self.rendezvous.timeout_s)

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.destroy()
        elif self.rendezvous.style == "torch":
            dist.destroy_process_group(self.group)
        else:
            shutdown = getattr(self.group, "shutdown", None)
            if callable(shutdown):
                shutdown()
        self.group = self._store = self._nccl = None


def _store(rendezvous: Rendezvous, *, wait_for_workers: bool) -> dist.TCPStore:
    return dist.TCPStore(
        rendezvous.address,
        rendezvous.port,
        rendezvous.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=rendezvous.timeout_s),
        wait_for_workers=wait_for_workers,
    )


def _torch_group(rendezvous: Rendezvous) -> Any:
    """SGLang's `init_custom_process_group`, step for step: torch's rendezvous, the store
    under the group name, torch's factory (the group is registered under that name)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(rendezvous.tcp_uri, rendezvous.rank, rendezvous.world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    prefixed = dist.PrefixStore(rendezvous.group_name, store)
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        rendezvous.transport,
        prefixed,
        group_name=c10d.GroupName(rendezvous.group_name),
        backend_options=None,
        timeout=timeout,
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _vllm_nccl(rendezvous: Rendezvous, device: torch.device) -> Any:
    """vLLM's NCCL rendezvous (what its trainer engine and TRL open): its own store protocol
    and communicator, so it needs vllm here too."""
    try:
        from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    except ImportError as exc:
        raise RuntimeError(
            "vLLM's NCCL weight-transfer rendezvous needs vllm installed on the server "
            "(the vLLM image has it); rlserve's own /v1/weights/transfer needs nothing"
        ) from exc
    return stateless_init_process_group(
        rendezvous.address, rendezvous.port, rendezvous.rank, rendezvous.world_size, device
    )
