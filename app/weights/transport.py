"""The server's member of the weight-transfer collective: it joins the trainer's rendezvous at
its rank and receives each bucket into a buffer. One `Connection` says which group; each
rendezvous protocol is one `Group` class, registered by style (and transport, where that
decides): a new one is a class and its `@registered` line.

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
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from rlserve_client.collective import (
    Transport,
    broadcast_slices,
    join,
    process_group,
    wait_all,
)

__all__ = [
    "BUCKET_BYTES",
    "STREAMS",
    "TIMEOUT_S",
    "Connection",
    "Group",
    "Packing",
    "RendezvousStyle",
    "Transport",
    "TransportChoice",
    "open_group",
]

RendezvousStyle = Literal["rlserve", "vllm", "torch"]
TransportChoice = Literal["auto", "gloo", "nccl"]
"""auto: NCCL for a model on a GPU, gloo otherwise."""
Packing = Literal["announced", "vllm", "in_band"]
"""How updates that name no buckets are cut: one tensor per bucket, or as vLLM's packed
transfer cuts them (tensors until a bucket passes the join's bucket_bytes); or the trainer
names each update's tensors over the group itself, as prime-rl's does (`in_band`: an
announcement names none)."""

BUCKET_BYTES = 512 << 20
STREAMS = 4
TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Connection:
    """A trainer's collective group as the server joins it, one type from the request that
    asks (`app.updates.types.Join`) to each rank's group (`open_group`): where the trainer's
    rendezvous listens (it is rank 0 and hosts the store), the group's shape and protocol,
    and how its updates are cut. Flat, as vLLM's engine passes it to its workers."""

    address: str
    port: int
    world_size: int
    rank_offset: int = 1
    """The server's first rank (each of its ranks follows)."""
    transport: TransportChoice = "auto"
    style: RendezvousStyle = "rlserve"
    group_name: str = ""
    """The "torch" style's group name (its store prefix)."""
    streams: int = STREAMS
    """Broadcasts in flight per bucket (rlserve's rendezvous only)."""
    timeout_s: float = TIMEOUT_S
    bucket_bytes: int = BUCKET_BYTES
    """The largest bucket an update may pack (one tensor alone may be larger)."""
    packing: Packing = "announced"
    listen_grace_s: float = 0.0
    """How long the rendezvous may refuse connections before the join is refused (the
    server's weights.rendezvous_grace_s, which the server sets)."""

    @property
    def tcp_uri(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"tcp://{host}:{self.port}"

    def same_group(self, other: Connection) -> bool:
        """Whether `other` names this very group (a restarted trainer joining again)."""
        if self.style != other.style:
            return False
        if self.style == "torch":
            return self.group_name == other.group_name
        return (self.address, self.port) == (other.address, other.port)


class Group(ABC):
    """A joined group, at one rank; `receive` fills a buffer from rank 0 (the trainer)."""

    def __init__(self, connection: Connection, rank: int, device: torch.device) -> None:
        self.connection, self.rank, self.device = connection, rank, device

    @abstractmethod
    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        """Start filling `buffer` (1-D bytes) with rank 0's next bucket; the returned call
        waits for it (raising on timeout or a lost peer). Buckets arrive in call order."""

    @abstractmethod
    def close(self) -> None: ...


GROUPS: dict[tuple[RendezvousStyle, Transport | None], type[Group]] = {}
"""The groups by rendezvous style and, where it decides, transport."""


def registered(
    style: RendezvousStyle, transport: Transport | None = None
) -> Callable[[type[Group]], type[Group]]:
    def register(cls: type[Group]) -> type[Group]:
        GROUPS[style, transport] = cls
        return cls

    return register


def open_group(connection: Connection, local_rank: int, device: torch.device) -> Group:
    """Join `connection`'s group as this process's rank `local_rank` of the server's."""
    assert connection.transport != "auto", "the server resolves the transport first"
    transport: Transport = connection.transport
    cls = GROUPS.get((connection.style, transport)) or GROUPS[connection.style, None]
    return cls(connection, connection.rank_offset + local_rank, device)


class BroadcastGroup(Group):
    """A torch process group that receives each bucket as one broadcast from rank 0, or as
    `streams` slices in flight at once."""

    group: Any
    store: Any = None
    """The trainer's store, held while the group lives (rlserve's and vLLM's rendezvous)."""
    streams = 1

    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        works = broadcast_slices(self.group, buffer, self.streams)
        return lambda: wait_all(works, self.connection.timeout_s)

    def close(self) -> None:
        shutdown = getattr(self.group, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self.group = self.store = None


@registered("rlserve")
class RlserveGroup(BroadcastGroup):
    """rlserve's own: a bare group over the store under STORE_PREFIX, a warm-up broadcast,
    each bucket broadcast as `streams` slices."""

    def __init__(self, connection: Connection, rank: int, device: torch.device) -> None:
        super().__init__(connection, rank, device)
        self.store, self.group = join(
            connection.address,
            connection.port,
            rank,
            connection.world_size,
            _transport(connection),
            connection.streams,
            connection.timeout_s,
            device,
        )
        self.streams = connection.streams


@registered("vllm", "gloo")
class VllmGlooGroup(BroadcastGroup):
    """vLLM's stateless gloo group, as `vllm.distributed.utils.
    stateless_init_torch_distributed_process_group` opens it: the store (which counts its
    workers: a trainer's master waits until all joined) under the `tcp://host:port` prefix.
    One broadcast per bucket, no warm-up."""

    def __init__(self, connection: Connection, rank: int, device: torch.device) -> None:
        super().__init__(connection, rank, device)
        self.store = dist.TCPStore(
            connection.address,
            connection.port,
            connection.world_size,
            is_master=False,
            timeout=datetime.timedelta(seconds=connection.timeout_s),
            wait_for_workers=True,
        )
        prefixed = dist.PrefixStore(connection.tcp_uri, self.store)
        self.group = process_group(
            "gloo", prefixed, rank, connection.world_size, connection.timeout_s
        )


@registered("vllm", "nccl")
class VllmNcclGroup(Group):
    """vLLM's NCCL rendezvous (what its trainer engine and TRL open): its own store protocol
    and communicator (`StatelessProcessGroup`, `PyNcclCommunicator`), so it needs vllm
    installed here too."""

    def __init__(self, connection: Connection, rank: int, device: torch.device) -> None:
        super().__init__(connection, rank, device)
        try:
            from vllm.distributed.weight_transfer.nccl_common import (
                stateless_init_process_group,
            )
        except ImportError as exc:
            raise RuntimeError(
                "vLLM's NCCL weight-transfer rendezvous needs vllm installed on the server "
                "(the vLLM image has it); rlserve's own /v1/weights/transfer needs nothing"
            ) from exc
        self.communicator: Any = stateless_init_process_group(
            connection.address, connection.port, rank, connection.world_size, device
        )

    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        self.communicator.broadcast(buffer, src=0, stream=torch.cuda.current_stream())
        return torch.cuda.current_stream().synchronize

    def close(self) -> None:
        self.communicator.destroy()
        self.communicator = None


@registered("torch")
class TorchGroup(BroadcastGroup):
    """torch.distributed's `init_process_group` recipe with a group name, step for step as
    SGLang's `init_custom_process_group` (and the trainers that drive SGLang: slime, AReaL)
    opens it: torch's tcp:// rendezvous, the store under the group name, torch's own
    process-group factory (the group is registered under that name). One broadcast per
    bucket."""

    def __init__(self, connection: Connection, rank: int, device: torch.device) -> None:
        super().__init__(connection, rank, device)
        from torch.distributed import distributed_c10d as c10d

        timeout = datetime.timedelta(seconds=connection.timeout_s)
        store, rank, world_size = next(
            c10d.rendezvous(connection.tcp_uri, rank, connection.world_size, timeout=timeout)
        )
        store.set_timeout(timeout)
        prefixed = dist.PrefixStore(connection.group_name, store)
        self.group, _ = c10d._new_process_group_helper(
            world_size,
            rank,
            [],
            _transport(connection),
            prefixed,
            group_name=c10d.GroupName(connection.group_name),
            backend_options=None,
            timeout=timeout,
        )
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(world_size)}

    def close(self) -> None:
        dist.destroy_process_group(self.group)  # (registered under its name: unregistered too)
        self.group = None


def _transport(connection: Connection) -> Transport:
    assert connection.transport != "auto"
    return connection.transport


STAND_IN_TIMEOUT_S = 10.0


def stand_in(connection: Connection, rank: int) -> None:
    """Join a group the server refused to join, at one of the ranks it would have taken, and
    leave it at once (blocking: call in a thread). A trainer joining as rank 0 beside its
    request waits for every rank at its rendezvous (slime and AReaL for 30 minutes by
    default) before it reads the server's refusal; a stand-in completes the rendezvous, so
    the refusal reaches the trainer's own call at once. Each rendezvous as its own trainer's
    side expects it: the "torch" style over gloo and the "vllm" style over gloo join whole
    (their group forms once every rank joined); the "torch" style over NCCL needs only the
    store (its communicator starts at the first collective). Not the "vllm" style over NCCL
    (its communicator's init has no timeout: a stand-in could hang), nor rlserve's own (its
    client stands in itself), which `stands_in` says."""
    standing = replace(connection, timeout_s=min(connection.timeout_s, STAND_IN_TIMEOUT_S))
    if standing.style == "torch" and standing.transport == "nccl":
        from torch.distributed import distributed_c10d as c10d

        timeout = datetime.timedelta(seconds=standing.timeout_s)
        store, _, _ = next(
            c10d.rendezvous(standing.tcp_uri, rank, standing.world_size, timeout=timeout)
        )
        del store
        return
    cls = GROUPS.get((standing.style, _transport(standing))) or GROUPS[standing.style, None]
    group = cls(standing, rank, torch.device("cpu"))
    group.close()


def stands_in(connection: Connection) -> bool:
    """Whether `stand_in` can end a refused trainer's rendezvous for this group (its
    transport resolved)."""
    if connection.style == "torch":
        return True
    return connection.style == "vllm" and connection.transport == "gloo"
