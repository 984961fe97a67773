"""The trainer's side of collective weight transfer (`Client.weight_transfer`).

    with client.weight_transfer(master_address="10.0.0.5") as sync:
        for step in training:
            ...
            sync.send(model)            # an nn.Module or a state dict

The trainer is rank 0 of a bare torch process group (gloo, or NCCL for tensors on a GPU; the
default group is never touched) that the server's model workers join. Each `send` runs the
server's protocol: start, update (the server checks the announced tensors and starts
receiving), the buckets' broadcast, finish (the server swaps them in while serving is paused and
answers with the version it published). Tensors travel packed in buckets of at most
`bucket_bytes`: a bucket is its tensors' bytes back to back, broadcast as `streams` slices in
flight together. If anything fails mid-way the server drops the update: its weights stay as
they were."""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from rlserve_client.types import TransferState, WeightsUpdated

if TYPE_CHECKING:
    import torch

    from rlserve_client._client import Client

STORE_PREFIX = "rlserve-weight-transfer"  # the server's app.weights.transport agrees


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
        streams: int = 4,
        timeout_s: float = 120.0,
    ) -> None:
        self.client = client
        self.model = model
        self.master_address = master_address
        self.master_port = master_port
        self.transport = transport
        self.bucket_bytes = bucket_bytes
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
        group = _in_thread(_join, transport, prefixed, world_size, timeout)
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
        buckets = list(_buckets(tensors, self.bucket_bytes))
        self._step("start", {})
        try:
            self._step("update", announcement(tensors, buckets))
            for bucket in buckets:
                self._broadcast(_packed(bucket, device))
        except BaseException:
            with contextlib.suppress(Exception):
                self._step("abort", {})
            raise
        return self.client.transfer_finish(model=self.model, version=version, pause=pause)

    def _broadcast(self, buffer: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        size = buffer.numel()
        if size == 0:
            return
        step = -(-size // max(1, self.streams))
        works = [
            self._group.broadcast([buffer[start : start + step]], options)
            for start in range(0, size, step)
        ]
        for work in works:
            work.wait(datetime.timedelta(seconds=self.timeout_s))

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


def _join(transport: str, store: Any, world_size: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if transport == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, 0, world_size, options)
    return dist.ProcessGroupGloo(store, 0, world_size, timeout)


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
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[torch.Tensor]]:
    """Tensors in order, grouped greedily up to `bucket_bytes` (a larger one goes alone)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for _, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def _packed(bucket: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The bucket's bytes back to back, on the transport's device."""
    import torch

    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in bucket]
    return torch.cat([p.to(device, non_blocking=True) for p in parts])


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
