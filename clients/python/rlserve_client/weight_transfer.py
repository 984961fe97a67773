"""The trainer's side of collective weight transfer (`Client.weight_transfer`).

    with client.weight_transfer(master_address="10.0.0.5") as sync:
        for step in training:
            ...
            sync.send(model)            # an nn.Module or a state dict
            # or, for a LoRA adapter of the policy (a PEFT model): its next version
            sync.send_adapter(peft_model, "my-adapter")

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
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rlserve_client.types import TransferState, WeightsUpdated

if TYPE_CHECKING:
    import torch


class TransferRoutes(Protocol):
    """The client calls a transfer makes (`rlserve_client.Client` has them)."""

    def transfer_state(self, *, model: str = ...) -> TransferState: ...

    def transfer_step(self, *, step: str, body: dict[str, Any]) -> TransferState: ...

    def transfer_finish(
        self, *, model: str = ..., version: int | None = ..., pause: str = ...
    ) -> WeightsUpdated: ...


PACKED_IN_FLIGHT = 2
STAND_IN_TIMEOUT_S = 10.0
"""How long stand-in ranks wait to end a refused join's rendezvous (`WeightSync.open`)."""


@dataclass(frozen=True)
class TransferOptions:
    """How the trainer joins the group and sends (`Client.weight_transfer`'s options)."""

    model: str = "policy"
    master_address: str = "127.0.0.1"
    """Where the server's ranks reach this trainer's rendezvous."""
    master_port: int = 0
    """0: any free port."""
    transport: str = "auto"
    """'gloo', 'nccl', or 'auto' (NCCL when the weights are on a GPU)."""
    bucket_bytes: int = 512 << 20
    pack_below_bytes: int = 1 << 20
    streams: int = 4
    timeout_s: float = 120.0
    deltas: bool = False
    """Send each push after the first as a delta of the last one the server took (both sides
    hold it): the bytes of rlserve's delta format (`weight_delta`) travel as one uint8 tensor,
    with every tensor cast to the served dtype; a push the server finds on another base (409)
    is sent whole. Needs the `[torch]` extra."""
    delta_max_share: float = 0.5
    """With `deltas`: a delta over this share of the whole push's bytes is sent whole instead
    (where most elements moved, as float32 weights' low bits do after a step, the receivers'
    rebuild costs more than the bytes save over a fast group)."""


class WeightSync:
    """A joined transfer group; `send` pushes one version of the weights."""

    def __init__(self, client: TransferRoutes, **options: Any) -> None:
        self.client = client
        self.options = TransferOptions(**options)
        self._group: Any = None
        self._store: Any = None
        self._encoder: Any = None
        """The last push the server took, when pushes are deltas (`TransferOptions.deltas`)."""
        self._dtype: torch.dtype | None = None

    # -- joining ---------------------------------------------------------------------------

    def open(self) -> WeightSync:
        import torch.distributed as dist

        from rlserve_client.collective import STORE_PREFIX

        state = self.client.transfer_state(model=self.options.model)
        world_size = 1 + state.server_ranks
        timeout = datetime.timedelta(seconds=self.options.timeout_s)
        # (torch.distributed re-exports these from torch._C: an error under --strict's global
        # no-implicit-reexport, not under the project's per-module strictness)
        self._store = dist.TCPStore(  # type: ignore[attr-defined,unused-ignore]
            "0.0.0.0",
            self.options.master_port,
            world_size,
            is_master=True,
            timeout=timeout,
            wait_for_workers=False,
        )
        transport = self._transport()
        body = {
            "model": self.options.model,
            "master_address": self.options.master_address,
            "master_port": self._store.port,
            "world_size": world_size,
            "transport": transport,
            "bucket_bytes": self.options.bucket_bytes,
            "streams": self.options.streams,
            "timeout_s": self.options.timeout_s,
        }
        # Both sides block in the rendezvous until everyone is in: the server's init runs on
        # a thread while this rank joins; an error from either side ends the wait.
        joined = _in_thread(self.client.transfer_step, step="init", body=body)
        store = self._store
        prefixed = dist.PrefixStore(STORE_PREFIX, store)  # type: ignore[attr-defined,unused-ignore]
        group = _in_thread(self._join, transport, prefixed, world_size)
        try:
            _first_error(joined, group, self.options.timeout_s + 10)
        except BaseException:
            self._abandon(joined, group, transport, world_size)
            raise
        self._group = group.result()
        joined.result()
        return self

    def _abandon(self, joined: Future[Any], group: Future[Any], transport: str, size: int) -> None:
        """A join that failed: leave nothing of ours waiting at the rendezvous. Where the
        server answered the init with an error, its ranks are not coming, and this rank's join
        would block until `timeout_s` in a thread that aborts the process if it wakes while
        the process exits. Stand-in ranks, each on a store connection of its own (one
        connection serves one waiting call at a time), complete the rendezvous and the warm-up
        instead, within STAND_IN_TIMEOUT_S, and the group is shut down. (Not where the server
        gave no answer, as its ranks may still be joining; and gloo only: NCCL takes one rank
        per device.)"""
        from rlserve_client._exceptions import APIStatusError
        from rlserve_client.collective import join

        answered = joined.done() and isinstance(joined.exception(), APIStatusError)
        if answered and not group.done() and transport == "gloo":
            grace = min(self.options.timeout_s, STAND_IN_TIMEOUT_S)
            port, streams, device = self._store.port, self.options.streams, _device(transport)

            def stand_in(rank: int) -> None:
                _, member = join("127.0.0.1", port, rank, size, transport, streams, grace, device)
                member.shutdown()

            stand_ins = [_in_thread(stand_in, rank) for rank in range(1, size)]
            wait([group, *stand_ins], timeout=grace + 5)
        if group.done() and group.exception() is None:
            with contextlib.suppress(Exception):
                group.result().shutdown()
        self._store = None

    def _transport(self) -> str:
        if self.options.transport != "auto":
            return self.options.transport
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
        if self.options.deltas:
            return self._send_delta(dict(_named_tensors(weights)), version, pause)
        return self._send(_named_tensors(weights), {}, version=version, pause=pause)

    def _send_delta(
        self, state: dict[str, torch.Tensor], version: int | None, pause: str
    ) -> WeightsUpdated:
        """`state` as a delta of the last push when it covers it (else whole), remembered as
        the next push's base."""
        import torch

        from rlserve_client._exceptions import ConflictError
        from rlserve_client.weight_delta import TRANSFER_NAME, DeltaEncoder
        from rlserve_client.weight_push import host_copies, served_dtype, served_version

        if self._encoder is None:
            self._encoder = DeltaEncoder()
            self._dtype = served_dtype(self.client, self.options.model)
        assert self._dtype is not None
        _, cast = host_copies(state, self._dtype)
        updated = None
        whole = sum(t.numel() * t.element_size() for t in cast.values())
        blob = (
            bytearray(self._encoder.encode(cast, version).blob)
            if self._encoder.covers(cast)
            else b""
        )
        if blob and len(blob) <= self.options.delta_max_share * whole:
            payload = [(TRANSFER_NAME, torch.frombuffer(blob, dtype=torch.uint8))]
            try:
                updated = self._send(payload, {}, version=version, pause=pause, delta=True)
            except ConflictError:  # not the base it was built on: whole
                updated = None
        if updated is None:
            updated = self._send(list(cast.items()), {}, version=version, pause=pause)
        self._encoder.remember(cast, served_version(updated, self.options.model), updated.digest)
        return updated

    def send_adapter(
        self,
        adapter: Any,
        name: str,
        *,
        config: Mapping[str, Any] | Any | None = None,
        adapter_name: str = "default",
    ) -> WeightsUpdated:
        """Push a LoRA adapter of the policy over the group: a PEFT model (its adapter
        `adapter_name`) or a mapping of PEFT's tensor names to tensors. The server serves it as
        adapter `name`'s next version without pausing (the answer's `adapter_version`); a name
        it does not serve yet needs the config (a PEFT model's own, or `config`), and is then
        owned by this client's key."""
        from rlserve_client.lora import adapter_parts, config_dict

        tensors, config = adapter_parts(adapter, config, adapter_name=adapter_name)
        target: dict[str, Any] = {"name": name}
        if config is not None:
            target["config"] = config_dict(config)
        return self._send(_named_tensors(tensors), {"adapter": target})

    def _send(
        self,
        tensors: list[tuple[str, torch.Tensor]],
        start: dict[str, Any],
        *,
        version: int | None = None,
        pause: str = "keep",
        delta: bool = False,
    ) -> WeightsUpdated:
        if self._group is None:
            raise RuntimeError(
                "the transfer group is not open (use `with client.weight_transfer()`)"
            )
        device = _device(self._transport())
        buckets = list(_buckets(tensors, self.options.bucket_bytes, self.options.pack_below_bytes))
        self._step("start", start)
        try:
            announced = announcement(tensors, buckets)
            self._step("update", {**announced, "delta": True} if delta else announced)
            self._broadcast(buckets, device)
        except BaseException:
            with contextlib.suppress(Exception):
                self._step("abort", {})
            raise
        return self.client.transfer_finish(model=self.options.model, version=version, pause=pause)

    def _broadcast(self, buckets: list[list[torch.Tensor]], device: torch.device) -> None:
        """Send every bucket in order, keeping several in flight."""
        from rlserve_client.collective import broadcast_slices

        in_flight: deque[tuple[bool, list[Any]]] = deque()
        for bucket in buckets:
            buffer, copied = _payload(bucket, device)
            while copied and sum(c for c, _ in in_flight) >= PACKED_IN_FLIGHT:
                self._wait(in_flight.popleft()[1])
            in_flight.append((copied, broadcast_slices(self._group, buffer, self.options.streams)))
        while in_flight:
            self._wait(in_flight.popleft()[1])

    def _wait(self, works: list[Any]) -> None:
        from rlserve_client.collective import wait_all

        wait_all(works, self.options.timeout_s)

    def _join(self, transport: str, store: Any, world_size: int) -> Any:
        """Rank 0's group, warmed up with the server's ranks (see `open`)."""
        from rlserve_client.collective import process_group, warm_up

        group = process_group(transport, store, 0, world_size, self.options.timeout_s)
        warm_up(group, _device(transport), self.options.streams, self.options.timeout_s)
        return group

    def _step(self, step: str, body: dict[str, Any]) -> TransferState:
        return self.client.transfer_step(step=step, body={"model": self.options.model, **body})

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
    # A copy to the GPU may overlap (the collective waits on the stream that made it); a
    # copy from the GPU to host memory may not: gloo would send the bytes before they land.
    overlap = device.type == "cuda"
    return torch.cat([p.to(device, non_blocking=overlap) for p in parts]), True


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
    done, pending = wait([a, b], timeout=timeout_s, return_when=FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()  # type: ignore[misc]
    if pending:
        raise TimeoutError(f"joining the transfer group took over {timeout_s:g} s")
