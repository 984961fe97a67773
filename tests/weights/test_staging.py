"""The pieces of a collective update on each side of the wire, without a group: how the
trainer cuts and packs buckets, how the server lays received bytes back out as tensors, checks
them, and hands them to the model."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from rlserve_client.weight_transfer import _buckets, _payload, announcement

from app.common.failures import InvalidInput
from app.weights.staging import TransferPlan, adopt, all_finite, receive_plan, staging_buffer

CPU = torch.device("cpu")


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    """Odd-sized bfloat16 tensors packed before float32 ones, so offsets go unaligned."""
    torch.manual_seed(0)
    return [
        ("a", torch.randn(3, dtype=torch.bfloat16)),
        ("b", torch.randn(5, 7)),
        ("big", torch.randn(64, 64)),
        ("c", torch.randint(0, 9, (3,), dtype=torch.int64)),
        ("d", torch.randn(1, dtype=torch.float16)),
        ("e", torch.tensor([True, False, True])),
        ("f", torch.randn(2, 3)),
    ]


class Wire:
    """Plays the trainer: each receive is served from the packed buckets in order, and the
    test can see how many receives were outstanding when the first one was awaited."""

    def __init__(self, payloads: list[torch.Tensor]) -> None:
        self.payloads = list(payloads)
        self.started = 0
        self.started_before_first_wait: int | None = None

    def receive(self, buffer: torch.Tensor) -> Callable[[], None]:
        payload = self.payloads[self.started]
        self.started += 1

        def arrived() -> None:
            if self.started_before_first_wait is None:
                self.started_before_first_wait = self.started
            buffer.copy_(payload)

        return arrived


def plan_and_wire(
    tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, pack_below_bytes: int
) -> tuple[TransferPlan, Wire]:
    buckets = list(_buckets(tensors, bucket_bytes, pack_below_bytes))
    body = announcement(tensors, buckets)
    plan = TransferPlan.parse(
        body["names"], body["dtype_names"], body["shapes"], body["buckets"], bucket_bytes
    )
    return plan, Wire([_payload(bucket, CPU)[0].clone() for bucket in buckets])


def test_large_tensors_travel_alone_and_small_ones_are_packed_in_order():
    tensors = mixed_tensors()
    buckets = list(_buckets(tensors, bucket_bytes=200, pack_below_bytes=1024))
    flat = [t for bucket in buckets for t in bucket]
    assert [id(t) for t in flat] == [id(t) for _, t in tensors]
    big = tensors[2][1]
    assert [big] in buckets
    for bucket in buckets:
        if len(bucket) > 1:
            assert sum(t.numel() * t.element_size() for t in bucket) <= 200
            assert all(t.numel() * t.element_size() < 1024 for t in bucket)


def test_a_lone_tensor_is_sent_from_its_own_memory_and_a_packed_bucket_is_its_bytes():
    lone = torch.randn(16, 16)
    payload, copied = _payload([lone], CPU)
    assert not copied and payload.data_ptr() == lone.data_ptr()
    transposed = lone.t()
    payload, copied = _payload([transposed], CPU)
    assert copied
    assert torch.equal(payload.view(torch.float32), transposed.contiguous().reshape(-1))
    parts = [torch.arange(3, dtype=torch.int16), torch.ones(2)]
    payload, copied = _payload(parts, CPU)
    assert copied and payload.numel() == 3 * 2 + 2 * 4
    assert torch.equal(payload[:6].view(torch.int16), parts[0])
    assert torch.equal(payload[6:].clone().view(torch.float32), parts[1])


@pytest.mark.parametrize("pack_below_bytes", [1, 64, 1 << 20])
def test_received_buckets_are_laid_out_as_the_sent_tensors(pack_below_bytes):
    tensors = mixed_tensors()
    plan, wire = plan_and_wire(tensors, bucket_bytes=256, pack_below_bytes=pack_below_bytes)
    staged = receive_plan(plan, wire.receive, CPU, CPU)
    assert list(staged) == [name for name, _ in tensors]
    for name, sent in tensors:
        assert staged[name].dtype == sent.dtype and torch.equal(staged[name], sent), name
    # Every bucket's receive was started before the first was awaited.
    assert wire.started_before_first_wait == len(plan.buckets)


def test_a_non_finite_tensor_fails_the_update_only_after_every_bucket_arrived():
    tensors = mixed_tensors()
    tensors[1] = ("b", tensors[1][1].clone())
    tensors[1][1][2, 3] = float("nan")
    plan, wire = plan_and_wire(tensors, bucket_bytes=64, pack_below_bytes=1 << 20)
    arrived: list[int] = []
    receive = wire.receive

    def counting(buffer: torch.Tensor) -> Callable[[], None]:
        wait = receive(buffer)
        return lambda: (wait(), arrived.append(1))[0]

    with pytest.raises(InvalidInput) as failure:
        receive_plan(plan, counting, CPU, CPU)
    assert "'b'" in str(failure.value) and len(arrived) == len(plan.buckets) > 2


def test_finiteness_is_exact_even_when_the_sum_overflows():
    large = torch.full((64,), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(large.sum())  # the fast path alone would call it bad
    assert all_finite(large)
    for bad in (float("inf"), float("-inf"), float("nan")):
        tensor = large.clone()
        tensor[7] = bad
        assert not all_finite(tensor)
    assert all_finite(torch.tensor([1, 2, 3]))
    assert all_finite(torch.empty(0))


def test_a_staging_buffer_outlives_its_first_reference():
    buffer = staging_buffer(3 << 20, CPU)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 << 20
    buffer.fill_(7)
    view = buffer[4 : 4 + 4 * 10].view(torch.float32)
    expected = torch.full((40,), 7, dtype=torch.uint8).view(torch.float32)
    del buffer
    assert torch.equal(view, expected)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("scale", torch.ones(4))


def test_adopted_tensors_become_the_models_without_a_copy_and_tied_names_follow():
    module = Tied()
    embed = torch.randn(10, 4)
    norm = torch.randn(4, dtype=torch.float64)  # another dtype: copied in, converted
    scale = torch.full((4,), 2.0)
    adopt(module, {"head.weight": embed, "norm.weight": norm, "scale": scale})
    assert module.embed.weight.data_ptr() == embed.data_ptr()
    assert module.head.weight is module.embed.weight
    assert module.norm.weight.dtype == torch.float32
    assert torch.equal(module.norm.weight, norm.float())
    assert torch.equal(module.scale, scale) and module.scale.data_ptr() != scale.data_ptr()
    assert isinstance(module.embed.weight, torch.nn.Parameter)


def test_adopted_in_place_the_parameters_keep_their_memory():
    """As under CUDA graphs (compiled decoding), which read parameters where they were
    captured."""
    module = Tied()
    where = {name: p.data_ptr() for name, p in module.named_parameters()}
    embed, norm = torch.randn(10, 4), torch.randn(4)
    adopt(module, {"head.weight": embed, "norm.weight": norm}, in_place=True)
    assert {name: p.data_ptr() for name, p in module.named_parameters()} == where
    assert torch.equal(module.embed.weight, embed) and module.head.weight is module.embed.weight
    assert torch.equal(module.norm.weight, norm)


@pytest.mark.vllm
@pytest.mark.filterwarnings("ignore:Tensor 'big' has size")  # larger than a bucket: sent alone
@pytest.mark.parametrize("limit", [1 << 8, 1 << 12, 1 << 16])
def test_buckets_cut_as_vllms_packing_cuts_them(limit):
    """The server cuts a packed vLLM update where vLLM's own `pack_tensors` does, and lays the
    packed bytes back out as the trainer's tensors."""
    packed = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    tensors = mixed_tensors()
    stream = iter(tensors)
    chunks = []
    while (chunk := packed.pack_tensors(stream, lambda item: item[1], limit)) is not None:
        chunks.append(chunk)
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    counts = TransferPlan.packed_like_vllm(shapes, dtypes, limit)
    assert counts == [len(c.names) for c in chunks]
    plan = TransferPlan.parse(names, dtypes, shapes, counts, limit)
    sent = iter(chunks)

    def receive(buffer: torch.Tensor) -> Callable[[], None]:
        buffer.copy_(next(sent).packed_tensor)
        return lambda: None

    staged = receive_plan(plan, receive, CPU, CPU)
    for name, tensor in tensors:
        assert torch.equal(staged[name], tensor)
