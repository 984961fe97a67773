"""Collective weight transfer (gloo on this CPU): the trainer's tensors are served exactly; a
version is published once per committed update; every failure leaves the served weights
bit-identical and the server serving."""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import torch
from rlserve_client import ConflictError, UnprocessableEntityError
from rlserve_client.weight_delta import DeltaEncoder, weights_digest
from rlserve_client.weight_transfer import _buckets, announcement
from transformers import AutoModelForCausalLM

from app.engine.builtin_model import build_model
from app.main import create_app
from tests.conftest import (
    assert_close,
    backend_settings,
    forward_log_probs,
    started,
    vllm_installed,
)
from tests.weights.conftest import Served, perturbed

SEQUENCES = [[5, 6, 7, 8, 9, 10, 11], [100, 101, 102, 7]]


def send(served: Served, weights: Any, **options: Any) -> Any:
    with served.trainer_client() as client, client.weight_transfer(**options) as sync:
        return sync.send(weights)


async def version(served: Served) -> int:
    return int((await served.http.get("/v1/weights/version")).json()["policy_version"])


async def test_the_transferred_weights_are_served_exactly(served, trainer_model, hf_model):
    new = perturbed(trainer_model, 0.8)
    current = await version(served)
    state = new.state_dict()
    # Small buckets and a low packing threshold: tensors travel both alone and packed.
    options = {"bucket_bytes": 1 << 17, "pack_below_bytes": 1 << 12, "streams": 3}
    result = await asyncio.to_thread(send, served, new, **options)
    assert result.policy_version == current + 1
    assert result.num_tensors == len(state)
    assert result.num_bytes == sum(t.numel() * t.element_size() for t in state.values())
    assert 0 <= result.seconds <= result.total_seconds
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(new, sequence), 1e-5)
    reference = await served.scores(SEQUENCES, "reference")
    for sequence, got in zip(SEQUENCES, reference, strict=True):
        assert_close(got, forward_log_probs(hf_model, sequence), 1e-5)
    assert (await served.http.get("/v1/weights/transfer")).json()["state"] == "idle"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_a_trainer_on_a_gpu_sends_its_tensors_over_gloo(served, trainer_model):
    """Tensors on the GPU travel through host memory over gloo: each copy has landed before
    it is sent (copied asynchronously, the bytes of a large tensor were sent half-written)."""
    new = perturbed(trainer_model, 1.25).cuda()
    options = {"transport": "gloo", "bucket_bytes": 1 << 17, "pack_below_bytes": 1 << 12}
    await asyncio.to_thread(send, served, new, **options)
    new = new.cpu()
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(new, sequence), 1e-5)


async def test_a_partial_update_changes_only_its_tensors(served, trainer_model):
    await asyncio.to_thread(send, served, trainer_model)
    name = "model.layers.0.mlp.down_proj.weight"
    changed = trainer_model.state_dict()[name] * -1.0
    await asyncio.to_thread(send, served, {name: changed})
    with torch.no_grad():
        trainer_model.get_parameter(name).copy_(changed)
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(trainer_model, sequence), 1e-5)


async def test_a_file_update_after_a_transfer_keeps_the_transferred_tensors(
    served, trainer_model, backend_name
):
    """A partial upload after a transfer changes only its own tensors, the others keeping the
    values the transfer sent. vLLM reloads whole models from files, and the transferred
    values are in none: there the partial upload is refused (409 naming the body, nothing
    changed) and a whole one applies."""
    from safetensors.torch import save

    sent = perturbed(trainer_model, 0.75)
    await asyncio.to_thread(send, served, sent)
    before, current = await served.scores(SEQUENCES), await version(served)
    digests = (await served.http.get("/ready")).json()["digests"]
    if backend_name == "vllm":
        # The transferred values are in vLLM's processes only: no digest, and no delta (it
        # builds on the served values, which the server reads from files).
        assert "policy" not in digests
        encoder = DeltaEncoder()
        encoder.remember(sent.state_dict(), current, None)
        nudged = {k: v + 1 for k, v in sent.state_dict().items() if k.endswith("norm.weight")}
        refused = await served.http.put("/v1/weights", content=encoder.encode(nudged).blob)
        assert refused.status_code == 409, refused.text
        assert "no file holds" in refused.json()["error"]["message"]
    else:
        assert digests["policy"] == weights_digest(sent.state_dict())
    name = "model.layers.1.mlp.up_proj.weight"
    changed = sent.state_dict()[name] * -0.5
    uploaded = await served.http.put("/v1/weights", content=save({name: changed.contiguous()}))
    with torch.no_grad():
        sent.get_parameter(name).copy_(changed)
    if backend_name == "vllm":
        assert uploaded.status_code == 409, uploaded.text
        error = uploaded.json()["error"]
        assert error["param"] == "body" and "collective transfer" in error["message"]
        assert await served.scores(SEQUENCES) == before
        assert await version(served) == current
        whole = {k: v.contiguous() for k, v in sent.state_dict().items()}
        uploaded = await served.http.put("/v1/weights", content=save(whole))
    assert uploaded.status_code == 200, uploaded.text
    assert await version(served) == current + 1
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(sent, sequence), 1e-5)
    # Every value is in a file again (vLLM): the digest is back, the trainer's own.
    digests = (await served.http.get("/ready")).json()["digests"]
    assert digests["policy"] == weights_digest(sent.state_dict())


async def test_versions_only_go_up(served, trainer_model):
    current = await version(served)
    first = perturbed(trainer_model, 0.9)
    state = {k: v.clone() for k, v in first.state_dict().items()}
    second = {k: v * 1.1 for k, v in state.items()}

    def trainer() -> list[Any]:
        outcomes: list[Any] = []
        with served.trainer_client() as client, client.weight_transfer() as sync:
            outcomes.append(sync.send(state, version=current + 5).policy_version)
            for requested in (current + 5, current + 4):
                try:
                    sync.send(second, version=requested)
                except ConflictError as exc:
                    outcomes.append(exc.param)
            outcomes.append(sync.send(second).policy_version)
        return outcomes

    assert await asyncio.to_thread(trainer) == [current + 5, "version", "version", current + 6]
    assert (await version(served)) == current + 6
    first.load_state_dict(second)
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(first, sequence), 1e-5)


async def test_bad_announcements_and_bad_values_change_nothing(served, trainer_model):
    await asyncio.to_thread(send, served, trainer_model)
    before, current = await served.scores(SEQUENCES), await version(served)
    name = "model.embed_tokens.weight"
    good = trainer_model.state_dict()[name]
    poisoned = good.clone()
    poisoned[3, 1] = math.nan
    cases = [
        ({"lm_head.nope": torch.zeros(3)}, "unknown parameter"),
        ({name: good[:-1]}, "shape"),
        ({name: good.double()}, "dtype"),
        ({name: poisoned}, "NaN"),
    ]

    def trainer() -> list[str]:
        messages = []
        with served.trainer_client() as client, client.weight_transfer() as sync:
            for weights, _ in cases:
                with pytest.raises(UnprocessableEntityError) as caught:
                    sync.send(weights)
                messages.append(caught.value.message)
            sync.send({name: good * 1.0})  # the group is still good for the next update
        return messages

    messages = await asyncio.to_thread(trainer)
    for message, (_, expected) in zip(messages, cases, strict=True):
        assert expected in message
    assert await served.scores(SEQUENCES) == before
    assert await version(served) == current + 1


@contextlib.asynccontextmanager
async def opened(served: Served) -> AsyncIterator[Any]:
    """A trainer's group with the server (joined and left from a thread: the app answers
    on this loop)."""
    with served.trainer_client() as client:
        sync = await asyncio.to_thread(client.weight_transfer().open)
        try:
            yield sync
        finally:
            await asyncio.to_thread(sync.close)


def sent_over(sync: Any, tensors: list[tuple[str, torch.Tensor]], buckets: list[Any]) -> None:
    """A send without its finish: start, announce, broadcast."""
    sync._step("start", {})
    sync._step("update", announcement(tensors, buckets))
    sync._broadcast(buckets, torch.device("cpu"))


async def test_a_replica_finishes_in_two_phases_and_hands_over_what_it_received(
    served, trainer_model
):
    """What a replica of several does at finish (app.deploy.replicated): `received` (every tensor
    in and checked; serving untouched), `checkpoint` (exactly the sent tensors, as one
    safetensors file for replicas that were not in the group), then `commit` under the
    version chosen for all replicas."""
    from safetensors.torch import load

    from app.updates.types import Publish

    transfers = served.app.state.weights.transfers
    before, current = await served.scores(SEQUENCES), await version(served)
    sent = {k: v.clone() for k, v in perturbed(trainer_model, 0.7).state_dict().items()}
    tensors = list(sent.items())
    buckets = list(_buckets(tensors, 1 << 16, 1 << 12))  # packed and lone tensors

    async with opened(served) as sync:
        await asyncio.to_thread(sent_over, sync, tensors, buckets)
        assert await transfers.received("policy") == current
        assert await served.scores(SEQUENCES) == before  # nothing applied yet
        handed = load(await transfers.checkpoint("policy"))
        assert handed.keys() == sent.keys()
        for name, tensor in sent.items():
            assert torch.equal(handed[name], tensor), name
        applied = await transfers.commit("policy", Publish(version=current + 3))
        assert applied.versions.policy == current + 3
    assert await version(served) == current + 3
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(trainer_model, sequence), 1e-5)


async def test_an_update_that_failed_on_another_replica_is_dropped_here(served, trainer_model):
    """`abandon` with another replica's failure: nothing applied; a lost peer there ends the
    group here too, a refused tensor does not."""
    from app.common.failures import InvalidInput, PeerFailed

    transfers = served.app.state.weights.transfers
    before, current = await served.scores(SEQUENCES), await version(served)
    tensors = list(perturbed(trainer_model, 0.6).state_dict().items())
    buckets = list(_buckets(tensors, 1 << 20, 1 << 20))

    async with opened(served) as sync:
        for failure, state in [
            (InvalidInput("weights: a NaN there", param="weights"), "joined"),
            (PeerFailed("receiving the weights failed there"), "idle"),
        ]:
            await asyncio.to_thread(sent_over, sync, tensors, buckets)
            await transfers.received("policy")
            await transfers.abandon("policy", failure)
            got = await transfers.state("policy")
            assert got.state == state and "there" in (got.last_error or "")
            assert await served.scores(SEQUENCES) == before
    assert await version(served) == current


def _stalled_trainer(served: Served, weights: dict[str, torch.Tensor], *, die: bool) -> float:
    """Announce everything, send the first bucket only, then stall (or leave the group as a
    dying process would). Returns how long the server took to give up on the update."""
    client = served.trainer_client()
    sync = client.weight_transfer(timeout_s=2.0, bucket_bytes=1 << 16)
    sync.open()
    tensors = list(weights.items())
    buckets = list(_buckets(tensors, 1 << 16, 1 << 16))
    assert len(buckets) > 1
    sync._step("start", {})
    sync._step("update", announcement(tensors, buckets))
    sync._broadcast(buckets[:1], torch.device("cpu"))
    start = time.monotonic()
    if die:
        sync._group.shutdown() if hasattr(sync._group, "shutdown") else None
        sync._group = None
    while client.transfer_state().state != "idle":
        assert time.monotonic() - start < 30, "the server kept waiting for a dead trainer"
        time.sleep(0.05)
    elapsed = time.monotonic() - start
    with pytest.raises(ConflictError):
        client.transfer_finish()  # nothing left to finish: the update was dropped
    client.close()
    return elapsed


@pytest.mark.parametrize("die", [False, True], ids=["stalls", "leaves"])
async def test_a_trainer_lost_mid_transfer_changes_nothing(served, trainer_model, die):
    await asyncio.to_thread(send, served, trainer_model)
    before, current = await served.scores(SEQUENCES), await version(served)
    weights = perturbed(trainer_model, 0.5).state_dict()
    elapsed = await asyncio.to_thread(_stalled_trainer, served, weights, die=die)
    assert elapsed < 10
    state = (await served.http.get("/v1/weights/transfer")).json()
    assert state["state"] == "idle" and state["last_error"]
    assert await served.scores(SEQUENCES) == before  # bit-identical
    assert await version(served) == current
    generated = await served.http.post(
        "/v1/generate", json={"tokens": [[5, 6]], "max_new_tokens": 4}
    )
    assert generated.status_code == 200
    result = await asyncio.to_thread(send, served, weights)  # a new trainer gets in
    assert result.policy_version == current + 1


async def test_a_trainer_that_never_joins_is_the_callers_failure(served, trainer_model):
    """Nobody at the rendezvous address: a 409 naming master_address within seconds. Something
    listening there that never joins: a 409 naming timeout_s once it has passed. Either way a
    4xx (the caller's failure, not the server's), the server out of any group, and a real
    trainer gets in afterwards."""
    import socket

    from tests.e2e.server import free_port

    body = {"master_address": "127.0.0.1", "world_size": 2, "rank_offset": 1, "timeout_s": 2}
    start = time.monotonic()
    nobody = await served.http.post(
        "/v1/weights/transfer/init", json={**body, "master_port": free_port()}
    )
    assert nobody.status_code == 409, nobody.text
    assert nobody.json()["error"]["param"] == "master_address"
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never speaks
        port = silent.getsockname()[1]
        joined = await served.http.post(
            "/v1/weights/transfer/init", json={**body, "master_port": port}
        )
    assert joined.status_code == 409, joined.text
    error = joined.json()["error"]
    assert error["param"] == "timeout_s" and "no trainer joined" in error["message"]
    assert time.monotonic() - start < 60
    state = (await served.http.get("/v1/weights/transfer")).json()
    assert state["state"] == "idle"
    current = await version(served)
    result = await asyncio.to_thread(send, served, trainer_model)
    assert result.policy_version == current + 1


async def test_a_refused_trainer_is_left_with_nothing_waiting(served, trainer_model):
    """A trainer refused at init (here: another trainer holds the group) gets the 409 at once,
    and nothing of its own rendezvous is left waiting: a thread still blocked there wakes at
    its timeout, and one that wakes while its process exits aborts that process."""

    def refused() -> tuple[float, list[str], int]:
        with served.trainer_client() as first, first.weight_transfer() as holding:
            with served.trainer_client() as second:
                start = time.monotonic()
                with pytest.raises(ConflictError, match="transfer/close"):
                    second.weight_transfer(timeout_s=600).open()
                took = time.monotonic() - start
            for _ in range(100):  # (a thread ends just after it hands over its result)
                waiting = [t.name for t in threading.enumerate() if "weight-transfer" in t.name]
                if not waiting:
                    break
                time.sleep(0.02)
            return took, waiting, holding.send(trainer_model).policy_version

    current = await version(served)
    took, waiting, published = await asyncio.to_thread(refused)
    assert took < 10 and waiting == []
    assert published == current + 1  # the group that holds it is untouched


async def test_a_join_answers_at_once_where_its_outcome_is_known(served):
    """The rendezvous grace (30 s) is for a trainer still opening its listener: an address
    that never resolves is refused at once, and a close during a join still waiting for its
    trainer ends the join at once (409) and answers at once itself."""
    from tests.e2e.server import free_port

    body = {"world_size": 2, "rank_offset": 1, "timeout_s": 600}
    start = time.monotonic()
    # (a name that does not resolve; one no resolver takes: a label over 63 characters)
    for address in ("no-such-host.invalid", "0" * 100):
        unresolvable = await served.http.post(
            "/v1/weights/transfer/init",
            json={**body, "master_address": address, "master_port": 29500},
        )
        assert unresolvable.status_code == 409, unresolvable.text
        assert unresolvable.json()["error"]["param"] == "master_address"
    assert time.monotonic() - start < 5
    waiting = asyncio.create_task(
        served.http.post(
            "/v1/weights/transfer/init",
            json={**body, "master_address": "127.0.0.1", "master_port": free_port()},
        )
    )
    await asyncio.sleep(1.0)  # the join waits for a listener there
    assert not waiting.done()
    start = time.monotonic()
    closed = await served.http.post("/v1/weights/transfer/close", json={})
    assert closed.status_code == 200 and closed.json()["state"] == "idle", closed.text
    joined = await waiting
    assert time.monotonic() - start < 5
    assert joined.status_code == 409 and joined.json()["error"]["param"] == "model", joined.text
    assert "the join was closed" in joined.json()["error"]["message"]


@pytest.mark.vllm
@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed here")
async def test_vllm_takes_tied_embedding_models_over_the_transfer(settings, tmp_path):
    """Refused over HTTP (vLLM's file reload mishandles the tied head); exact here."""
    tied_dir = build_model(tmp_path / "tied", seed=2, tie_embeddings=True)
    config = backend_settings(settings, "vllm").replace(
        models={"model": str(tied_dir), "load_reference": False},
        storage={"data_dir": tmp_path / "data"},
    )
    app = create_app(config)
    async with app.router.lifespan_context(app):
        await started(app)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120
        ) as http:
            served = Served(app, http, asyncio.get_running_loop())
            model = AutoModelForCausalLM.from_pretrained(tied_dir, dtype=torch.float32).eval()
            assert model.lm_head.weight is model.model.embed_tokens.weight
            new = perturbed(model, 1.3)
            result = await asyncio.to_thread(send, served, new)
            assert result.policy_version == 1
            for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
                assert_close(got, forward_log_probs(new, sequence), 1e-4)
