"""The trainer's side of collective weight transfer (`Client.weight_transfer`).

    with client.weight_transfer(master_address="10.0.0.5") as sync:
        for step in training:
            ...
            sync.send(model)            # an nn.Module or a state dict

The trainer is rank 0 of a bare torch process group (gloo, or NCCL for tensors on a GPU; the
default group is never touched) that the server's model workers join. Each `send` runs the
server's protocol: start, update (the server checks the announced tensors and starts
receiving), the buckets' broadcast, finish (the server swaps them in while serving is paused and
answers with the version it published). A tensor of at least `pack_below_bytes` travels
alone, straight from its own memory; smaller ones are packed in buckets of at most
`bucket_bytes` (their bytes back to back), so a model's many small tensors cost few
broadcasts. Each bucket is broadcast as `streams` slices in flight together, and the next
buckets are sent while earlier ones are still moving (at most two packed copies alive at
once). If anything fails mid-way the server drops the update: its weights stay as they were."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rlserve_client.types import TransferState, WeightsUpdated

if TYPE_CHECKING:
    import torch

    from rlserve_client._client import Client

# The server's app.weights.transport agrees on these.
STORE_PREFIX = "rlserve-weight-transfer"
WARMUP_BYTES = 1 << 20
PACKED_IN_FLIGHT = 2


class WeightSync:
    """A joined transfer group; `send` pushes one version of the weights."""

    def __init__(
        self,
        client: Client,
        *,
        model: str = "policy",
        master_address: str = "127.0.0.1",
        master_port: int = 0,
        transport: str = "auto",
        bucket_bytes: int = 512 << 20,
        pack_below_bytes: int = 1 << 20,
        streams: int = 4,
        timeout_s: float = 120.0,
    ) -> None:
        self.client = client
        self.model = model
        self.master_address = master_address
        self.master_port = master_port
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.pack_below_bytes = pack_below_bytes
        self.streams = streams
        self.timeout_s = timeout_s
        self._group: Any = None
        self._store: Any = None

    # -- joining ---------------------------------------------------------------------------

    def open(self) -> WeightSync:
        import torch.distributed as dist

        state = self.client.transfer_state(model=self.model)
        world_size = 1 + state.server_ranks
        timeout = datetime.timedelta(seconds=self.timeout_s)
        self._store = dist.TCPStore(  # type: ignore[attr-defined]
            "0.0.0.0",
            self.master_port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        transport = self._transport()
        body = {
            "model": self.model,
            "master_address": self.master_address,
            "master_port": self._store.port,
            "world_size": world_size,
            "transport": transport,
            "bucket_bytes": self.bucket_bytes,
            "streams": self.streams,
            "timeout_s": self.timeout_s,
        }
        # Both sides block in the rendezvous until everyone is in: the server's init runs on
        # a thread while this rank joins; an error from either side ends the wait.
        joined = _in_thread(self.client.transfer_step, step="init", body=body)
        prefixed = dist.PrefixStore(STORE_PREFIX, self._store)  # type: ignore[attr-defined]
        group = _in_thread(self._join, transport, prefixed, world_size)
        _first_error(joined, group, self.timeout_s + 10)
        self._group = group.result()
        joined.result()
        return self

    def _transport(self) -> str:
        if self.transport != "auto":
            return self.transport
        import torch

        return "nccl" if torch.cuda.is_available() else "gloo"

    # -- sending ---------------------------------------------------------------------------

    def send(
        self,
        weights: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        pause: str = "keep",
    ) -> WeightsUpdated:
        """Push every tensor of `weights` (a module's state dict, or a mapping of HF names to
        tensors: any subset of the model). `version`: the version to publish (above the
        current one); `pause`: how in-flight generations meet the swap (keep, wait, abort)."""
        if self._group is None:
            raise RuntimeError(
                "the transfer group is not open (use `with client.weight_transfer()`)"
            )
        tensors = _named_tensors(weights)
        device = _device(self._transport())
        buckets = list(_buckets(tensors, self.bucket_bytes, self.pack_below_bytes))
        self._step("start", {})
        try:
            self._step("update", announcement(tensors, buckets))
            self._broadcast(buckets, device)
        except BaseException:
            with contextlib.suppress(Exception):
                self._step("abort", {})
            raise
        return self.client.transfer_finish(model=self.model, version=version, pause=pause)

    def _broadcast(self, buckets: list[list[torch.Tensor]], device: torch.device) -> None:
        """Send every bucket in order, keeping several in flight."""
        in_flight: deque[tuple[bool, list[Any]]] = deque()
        for bucket in buckets:
            buffer, copied = _payload(bucket, device)
            while copied and sum(c for c, _ in in_flight) >= PACKED_IN_FLIGHT:
                self._wait(in_flight.popleft()[1])
            in_flight.append((copied, _post(self._group, buffer, self.streams)))
        while in_flight:
            self._wait(in_flight.popleft()[1])

    def _wait(self, works: list[Any]) -> None:
        for work in works:
            work.wait(datetime.timedelta(seconds=self.timeout_s))

    def _join(self, transport: str, store: Any, world_size: int) -> Any:
        """Rank 0's group, warmed up with the server's ranks (see `open`)."""
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        group: Any
        if transport == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(store, 0, world_size, options)
        else:
            group = dist.ProcessGroupGloo(store, 0, world_size, timeout)
        warmup = torch.zeros(WARMUP_BYTES, dtype=torch.uint8, device=_device(transport))
        self._wait(_post(group, warmup, self.streams))
        return group

    def _step(self, step: str, body: dict[str, Any]) -> TransferState:
        return self.client.transfer_step(step=step, body={"model": self.model, **body})

    # -- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._step("close", {})
        group, self._group = self._group, None
        shutdown = getattr(group, "shutdown", None)
        if callable(shutdown):
            with contextlib.suppress(Exception):
                shutdown()
        self._store = None

    def __enter__(self) -> WeightSync:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _named_tensors(
    weights: torch.nn.Module | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    import torch

    state = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    return [(name, tensor.detach()) for name, tensor in state.items()]


def announcement(
    tensors: list[tuple[str, torch.Tensor]], buckets: list[list[torch.Tensor]]
) -> dict[str, Any]:
    """The body of an update call: what the buckets will carry, in order."""
    return {
        "names": [name for name, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        "buckets": [len(bucket) for bucket in buckets],
    }


def _device(transport: str) -> torch.device:
    import torch

    if transport == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _buckets(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, pack_below_bytes: int
) -> Iterator[list[torch.Tensor]]:
    """Tensors in order: one of at least `pack_below_bytes` alone, smaller ones grouped
    greedily up to `bucket_bytes`."""
    bucket: list[torch.Tensor] = []
    size = 0
    for _, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        alone = nbytes >= pack_below_bytes
        if bucket and (alone or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        if alone:
            yield [tensor]
            continue
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _payload(bucket: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The bucket's bytes back to back on the transport's device, and whether that took a
    copy (a lone contiguous tensor already there is sent from its own memory)."""
    import torch

    if len(bucket) == 1 and bucket[0].is_contiguous() and bucket[0].device == device:
        return bucket[0].reshape(-1).view(torch.uint8), False
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in bucket]
    return torch.cat([p.to(device, non_blocking=True) for p in parts]), True


def _post(group: Any, buffer: torch.Tensor, streams: int) -> list[Any]:
    """Start broadcasting `buffer` as `streams` slices; the works to wait for."""
    import torch.distributed as dist

    options = dist.BroadcastOptions()
    options.rootRank = 0
    size = buffer.numel()
    if size == 0:
        return []
    step = -(-size // max(1, streams))
    return [
        group.broadcast([buffer[start : start + step]], options) for start in range(0, size, step)
    ]


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> Future[Any]:
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="rlserve-weight-transfer").start()
    return future


def _first_error(a: Future[Any], b: Future[Any], timeout_s: float) -> None:
    """Wait for both; raise as soon as either fails (the other is left to its own timeout)."""
    from concurrent.futures import FIRST_EXCEPTION, wait

    done, pending = wait([a, b], timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    if pending:
        raise TimeoutError(f"joining the transfer group took over {timeout_s:g} s")
