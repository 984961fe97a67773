"""The server side of collective weight transfer, one per served model, following vLLM's
weight-transfer protocol: `init` (join the trainer's group) → `start` → `update` (one or more:
announce tensors, then receive them) → `commit` (apply, while serving is paused) or `abort`,
and `close` to leave the group.

Received tensors are staged whole (`app.weights.staging`) and applied only at commit, so a
trainer that dies mid-transfer leaves the served weights bit-identical."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextvars import ContextVar

import torch

from app.common.failures import Conflict, PeerAbsent
from app.common.roles import Role
from app.weights.checkpoint import to_safetensors
from app.weights.staging import Reception, TransferPlan
from app.weights.transport import Connection, Group, open_group

JOIN_CLOSED: ContextVar[asyncio.Event | None] = ContextVar("join_closed", default=None)
"""Set around a join by the transfer service: a close call sets the event, and a join still
waiting for its trainer's rendezvous to listen gives way at once (`rendezvous_listening`)."""


async def rendezvous_listening(connection: Connection) -> None:
    """Return once something accepts connections at the trainer's address; a PeerAbsent
    naming `master_address` when nothing does within the connection's grace (or its timeout, if
    shorter), so a wrong address is refused well before the whole join timeout. (A trainer
    opens its rendezvous before or just after it asks the server to join, maybe from a
    process still importing torch: seconds on a loaded host.)"""
    address, port = connection.address, connection.port
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(connection.listen_grace_s, connection.timeout_s)
    closed = JOIN_CLOSED.get()
    # (each probe at most a second, so a close is seen within one)
    while refused := await _refused(address, port, min(max(deadline - loop.time(), 0.05), 1.0)):
        if closed is not None and closed.is_set():
            raise Conflict(
                f"the join was closed (a close call) before the trainer's rendezvous at "
                f"{address}:{port} accepted connections",
                role=Role.MODEL,
            )
        # Only a refused or unanswered connection may be a trainer still starting; an address
        # that does not resolve or cannot be reached never will be: refused at once.
        waiting = isinstance(refused, ConnectionRefusedError | TimeoutError) or (
            isinstance(refused, socket.gaierror) and refused.errno == socket.EAI_AGAIN
        )
        if not waiting or loop.time() >= deadline:
            raise PeerAbsent(
                f"nothing accepts connections at {address}:{port} (the "
                f"trainer's rendezvous): {type(refused).__name__}: {refused}",
                role=Role.GROUP_ADDRESS,
            ) from refused
        if closed is None:
            await asyncio.sleep(0.1)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(closed.wait(), 0.1)


async def rendezvous_answers(address: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at a trainer's rendezvous now (a trainer that
    is gone leaves nothing listening there)."""
    return await _refused(address, port, timeout_s) is None


async def _refused(address: str, port: int, timeout_s: float) -> Exception | None:
    """Why a connection to address:port failed within `timeout_s` (None: it was accepted,
    and is closed again)."""
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(address, port)
    except (OSError, TimeoutError, UnicodeError, ValueError) as exc:  # (a name idna refuses)
        return exc
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return None


class WeightTransfer(ABC):
    """One model's end of the transfer; calls come one at a time (the service serializes)."""

    ranks: int = 1
    """How many ranks this model's workers add to the group."""

    @abstractmethod
    async def init(self, connection: Connection) -> None: ...

    @abstractmethod
    async def start(self, *, adapter: bool = False) -> None:
        """Begin an update; `adapter`: its tensors are a LoRA adapter's (checked when it is
        served), not the model's."""

    @abstractmethod
    async def update(self, plan: TransferPlan) -> None:
        """Begin receiving `plan` (returns at once; the data arrives in the background)."""

    @abstractmethod
    async def received(self, timeout_s: float) -> None:
        """Wait until every announced tensor arrived and was checked."""

    @abstractmethod
    async def checkpoint(self) -> bytes:
        """The received tensors as one safetensors file (after `received`): what a server
        that was not in the group needs to serve the same weights."""

    @abstractmethod
    async def commit(self, version: int) -> None:
        """Apply the staged tensors (serving is paused meanwhile) and drop them."""

    @abstractmethod
    async def abort(self) -> None:
        """Drop whatever was staged; the served weights stay as they are."""

    @abstractmethod
    async def close(self) -> None:
        """Leave the group (abort first if an update is open)."""


Apply = Callable[[dict[str, torch.Tensor]], None]


class InProcessTransfer(WeightTransfer):
    """For a model in this process (the transformers backend): one rank, staging on the
    model's device, `apply` hands the staged tensors to the model (`staging.adopt`)."""

    def __init__(self, device: torch.device, apply: Apply) -> None:
        self.device = device
        self._apply = apply
        self._group: Group | None = None
        self._reception: Reception | None = None

    async def init(self, connection: Connection) -> None:
        if self._group is not None:
            raise Conflict("the model is already in a weight-transfer group; close it first")
        await rendezvous_listening(connection)
        self._group = await asyncio.to_thread(open_group, connection, 0, self.device)

    async def start(self, *, adapter: bool = False) -> None:
        group = self._joined()
        await self.abort()
        self._reception = Reception(group.receive, self.device)

    async def update(self, plan: TransferPlan) -> None:
        self._started().add(plan)

    async def received(self, timeout_s: float) -> None:
        reception = self._started()
        await asyncio.to_thread(reception.result, timeout_s)

    async def checkpoint(self) -> bytes:
        return await asyncio.to_thread(to_safetensors, self._started().result(0))

    async def commit(self, version: int) -> None:
        reception = self._started()
        staged = reception.result(0)
        await asyncio.to_thread(self._apply, staged)
        await self.abort()

    async def abort(self) -> None:
        reception, self._reception = self._reception, None
        if reception is not None:
            reception.close()

    async def close(self) -> None:
        await self.abort()
        group, self._group = self._group, None
        if group is not None:
            await asyncio.to_thread(group.close)

    def _joined(self) -> Group:
        if self._group is None:
            raise Conflict("no weight-transfer group: call init first")
        return self._group

    def _started(self) -> Reception:
        if self._reception is None:
            raise Conflict("no weight update in progress: call start first")
        return self._reception
