"""slime's requests to its SGLang servers, replayed as exact request bodies and read back as
slime reads the answers: slime is not on PyPI, so its code cannot be imported. Source:
THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515:
- `slime/rollout/sglang_rollout.py` (`GenerateState.__init__`'s sampling_params, `generate`'s
  payload and its reading of `meta_info.output_token_logprobs` as [log-prob, token id, _]);
- `slime/rollout/sglang_rollout.py`'s `abort()`: `GET /workers` at the router address (rlserve,
  as the trainers guide configures it), then for each worker's `url` what
  `slime/backends/sglang_utils/server_control.py` does (`abort_server_until_idle`: abort_all,
  then `GET /v1/loads?include=core` until no request is left), then the pending generations;
- `SGLangEngine._register_to_router` (`POST /workers` with the engine's own address, at every
  start of the trainer);
- `slime/backends/sglang_utils/sglang_engine.py` (pause_generation, `GET /flush_cache`,
  update_weights_from_disk / init_weights_update_group / update_weights_from_distributed,
  continue_generation) as `slime/ray/actor_group.py` and
  `slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py` order them:
  `connect_rollout_engines` once per trainer process (a fresh process sends no destroy first,
  so a restarted trainer joins the same group name again), then per push pause, flush, one
  update per bucket named with the process's count of pushes ("1", "2", ...: not restored from
  a checkpoint), continue.
The one change: slime's group `backend` is "nccl" on CUDA; this CPU test says "gloo"."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import assert_close, forward_log_probs
from tests.weights.conftest import Served, perturbed
from tests.weights.test_dialect_transfer import (
    SEQUENCES,
    post,
    sglang_group,
    sglang_update,
)
from tests.weights.test_dialect_transfer import served_version as rlserve_version

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]


def slime_sampling_params(max_new_tokens: int, **flags: Any) -> dict[str, Any]:
    """GenerateState's sampling_params with slime's default arguments, in its key order."""
    params: dict[str, Any] = {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": max_new_tokens,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
    }
    params.update(flags)
    if params["top_p"] != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    return params


async def slime_generate(served: Served, prompt: list[int], params: dict[str, Any]) -> Any:
    payload = {"sampling_params": params, "return_logprob": True, "input_ids": prompt}
    response = await served.http.post("/generate", json=payload)
    assert response.status_code == 200, response.text
    output = response.json()
    meta = output["meta_info"]
    tokens = [item[1] for item in meta["output_token_logprobs"]]
    log_probs = [item[0] for item in meta["output_token_logprobs"]]
    assert isinstance(output["text"], str)
    assert meta["finish_reason"]["type"] in ("length", "stop", "abort")
    assert isinstance(meta["weight_version"], str)
    return tokens, log_probs, meta


async def test_slimes_generate_requests_read_as_slime_reads_them(served, hf_tokenizer):
    eos = hf_tokenizer.eos_token_id
    for prompt in PROMPTS:
        tokens, log_probs, meta = await slime_generate(served, prompt, slime_sampling_params(6))
        # unseeded sampling, as slime's default: a reply may end early on end-of-sequence
        finish = meta["finish_reason"]["type"]
        assert (finish, len(tokens)) == ("length", 6) or (
            finish == "stop" and tokens[-1] == eos and len(tokens) <= 6
        )
        (scores,) = await served.scores([prompt + tokens])
        assert_close(log_probs, scores[len(prompt) :], 1e-4)
    # --rollout-stop-token-ids, --rollout-top-p 0.95 (slime then asks for top-p token ids in
    # custom_params) and deterministic mode's sampling_seed: the same seed, the same tokens
    params = slime_sampling_params(8, top_p=0.95, stop_token_ids=[eos, 7], sampling_seed=3)
    first = await slime_generate(served, PROMPTS[0], params)
    again = await slime_generate(served, PROMPTS[0], params)
    assert first[0] == again[0] and first[1] == again[1]
    tokens, _, meta = first
    stopped = [t for t in tokens if t in (eos, 7)]
    assert stopped == ([tokens[-1]] if meta["finish_reason"]["type"] == "stop" else [])


def num_requests_from_load(load: Any) -> int:
    """slime's reading of `/v1/loads` (server_control.num_requests_from_load), as written."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    for key in ("num_reqs", "num_total_reqs", "total_reqs"):
        value = load.get(key)
        if isinstance(value, int):
            return value
    running = load.get("num_running_reqs", load.get("total_running_reqs"))
    waiting = load.get("num_waiting_reqs", load.get("total_waiting_reqs"))
    return (running if isinstance(running, int) else 0) + (
        waiting if isinstance(waiting, int) else 0
    )


async def slime_abort(served: Served, pending: list[asyncio.Task[Any]]) -> tuple[list[str], int]:
    """slime's `abort()` with rlserve as the router address: the router's workers, then for
    each `abort_server_until_idle` (abort all, poll the load every 3 s until none is left),
    then the generations still pending. The worker urls, and how many abort rounds ran."""
    response = await served.http.get("/workers")  # slime's `get`: no retry, raise_for_status
    response.raise_for_status()
    urls = [worker["url"] for worker in response.json()["workers"]]
    rounds = 0
    for url in urls:
        # (bounded here: slime polls until the server is idle, however long that takes, and a
        # server that never gets there would hold the test to pytest's timeout)
        async with asyncio.timeout(120):
            rounds += await abort_until_idle(served, url)
    async with asyncio.timeout(120):
        await asyncio.gather(*pending)
    return urls, rounds


async def abort_until_idle(served: Served, url: str) -> int:
    """slime's `abort_server_until_idle` for one worker: how many abort rounds ran."""
    rounds = 0
    while True:
        rounds += 1
        aborted = await served.http.post(f"{url}/abort_request", json={"abort_all": True})
        assert aborted.status_code == 200, aborted.text
        loads = await served.http.get(f"{url}/v1/loads?include=core")
        loads.raise_for_status()
        if num_requests_from_load(loads.json()) <= 0:
            return rounds
        await asyncio.sleep(3)


async def test_slimes_abort_loop_finds_the_server_idle(served):
    params = slime_sampling_params(2000, ignore_eos=True)
    running = asyncio.create_task(slime_generate(served, PROMPTS[0], params))
    async with asyncio.timeout(60):
        while True:  # the generation is under way
            loads = (await served.http.get("/v1/loads", params={"include": "core"})).json()
            if loads["loads"][0]["num_running_reqs"] > 0:
                break
            await asyncio.sleep(0.01)
    assert loads["loads"][0]["num_total_reqs"] == 1
    urls, rounds = await slime_abort(served, [running])
    assert urls == ["http://t"] and rounds == 1  # the server itself, idle after one abort
    tokens, _, meta = await running
    assert meta["finish_reason"]["type"] == "abort" and len(tokens) < 2000
    loads = (await served.http.get("/v1/loads", params={"include": "core"})).json()
    assert loads["loads"][0] == {
        "dp_rank": 0,
        "num_running_reqs": 0,
        "num_waiting_reqs": 0,
        "num_total_reqs": 0,
    }
    # the end of a rollout with nothing in flight: one round, as at the end of every rollout
    assert await slime_abort(served, []) == (["http://t"], 1)


async def test_the_router_address_lists_and_registers_the_server_itself(served):
    listed = (await served.http.get("/workers")).json()
    (worker,) = listed["workers"]
    assert worker["url"] == "http://t" and worker["is_healthy"] is True
    assert uuid.UUID(worker["id"]) and listed["total"] == 1
    assert (await served.http.get("/list_workers")).json() == {"urls": ["http://t"]}
    # _register_to_router, at each start of the trainer: the same address, taken each time
    for _ in range(2):
        registered = await served.http.post(
            "/workers", json={"url": "http://t:80", "worker_type": "regular"}
        )
        assert registered.status_code == 200, registered.text
        assert registered.json()["worker_id"] == worker["id"]
    # an engine rlserve does not serve is refused: it routes to no other server
    other = await served.http.post("/workers", json={"url": "http://10.0.0.7:30000"})
    assert other.status_code == 422 and other.json()["error"]["param"] == "url"
    assert (await served.http.get("/workers")).json()["total"] == 1


async def served_version(served: Served) -> int:
    return int((await served.http.get("/get_weight_version")).json()["weight_version"])


async def assert_serves(served: Served, model: torch.nn.Module) -> None:
    for sequence, got in zip(SEQUENCES, await served.scores(SEQUENCES), strict=True):
        assert_close(got, forward_log_probs(model, sequence), 1e-5)


async def test_slimes_disk_update_serves_the_checkpoint(served, trainer_model, tmp_path):
    new = perturbed(trainer_model, 0.95)
    version = await served_version(served) + 1
    folder = tmp_path / f"weight_v{version:06d}"  # slime's update_weight_disk_dir layout
    new.save_pretrained(folder)
    await asyncio.to_thread(post, served, "/pause_generation", {})
    flushed = await served.http.get("/flush_cache")
    assert flushed.status_code == 200
    body = {"model_path": str(folder), "weight_version": str(version)}
    await asyncio.to_thread(post, served, "/update_weights_from_disk", body)
    await asyncio.to_thread(post, served, "/continue_generation", {})
    assert await served_version(served) == version
    await assert_serves(served, new)


def slime_distributed_update(
    served: Served, model: torch.nn.Module, version: int, tmp_path: Path
) -> None:
    """connect_rollout_engines, then update_weights: pause, flush, one
    update_weights_from_distributed per bucket (its tensors broadcast from rank 0 in `names`
    order), continue."""
    name = "slime-pp_0"
    tensors = list(model.state_dict().items())
    buckets = [tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]]
    sent = [(False, [t for _, t in bucket]) for bucket in buckets]
    with sglang_group(served, sent, name, tmp_path / "buckets.pt"):
        post(served, "/pause_generation", {})
        with served.trainer_client() as client:
            assert client._http.get("/flush_cache").status_code == 200
        for bucket in buckets:
            post(served, "/update_weights_from_distributed", sglang_update(bucket, name, version))
        post(served, "/continue_generation", {})
        post(served, "/destroy_weights_update_group", {"group_name": name})


def slime_trainer_process(
    served: Served,
    pushes: list[torch.nn.Module],
    tmp_path: Path,
    name: str = "slime-pp_0",
    backend: str = "gloo",
) -> None:
    """One slime trainer process against an external engine: connect_rollout_engines once (a
    fresh process sends no destroy first), then each push (pause, flush, two buckets named
    with the process's count of pushes, continue); then the process ends without destroying
    its group, as a trainer that stops or dies does. `backend` "nccl": slime's own, on a GPU
    host's last device."""
    buckets = []
    for model in pushes:
        tensors = list(model.state_dict().items())
        buckets.append([tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]])
    sent = [(False, [t for _, t in b]) for push in buckets for b in push]
    flags = ["exit", *(["nccl"] if backend == "nccl" else [])]
    saved = tmp_path / f"{name}-{uuid.uuid4().hex}.pt"
    with sglang_group(served, sent, name, saved, *flags, backend=backend):
        for count, push in enumerate(buckets, start=1):  # weight_version += 1 before each
            post(served, "/pause_generation", {})
            with served.trainer_client() as client:
                assert client._http.get("/flush_cache").status_code == 200
            for bucket in push:
                post(served, "/update_weights_from_distributed", sglang_update(bucket, name, count))
            post(served, "/continue_generation", {})


async def test_a_slime_trainer_restarted_from_a_checkpoint_goes_on(served, trainer_model, tmp_path):
    """A slime trainer pushes twice and stops, its group never destroyed. Restarted from a
    checkpoint, it joins the same group name again (no destroy first) and counts its pushes
    from "1" again, below the served version: every push is served, as the next version (a
    new lineage, shown in /ready and /metrics; rlserve's versions only go up), the SGLang
    routes give each version in the trainer's count, serving is never left paused, and the
    served weights are the restarted trainer's."""
    lineage = (await served.http.get("/ready")).json()["lineage"]["number"]
    start = await rlserve_version(served)
    first = [perturbed(trainer_model, 1.02), perturbed(trainer_model, 1.04)]
    await asyncio.to_thread(slime_trainer_process, served, first, tmp_path)
    assert await rlserve_version(served) == start + 2
    assert await served_version(served) == 2  # the trainer's count
    if start > 0:  # its "1" was below the served version: a lineage of its own
        lineage += 1
    ready = (await served.http.get("/ready")).json()
    assert ready["paused"] is False and ready["lineage"]["number"] == lineage
    await assert_serves(served, first[-1])

    again = [perturbed(first[-1], 0.97), perturbed(first[-1], 0.95)]
    await asyncio.to_thread(slime_trainer_process, served, again, tmp_path)
    assert await rlserve_version(served) == start + 4
    assert await served_version(served) == 2
    ready = (await served.http.get("/ready")).json()
    assert ready["paused"] is False
    assert ready["lineage"] == {
        "number": lineage + 1,
        "since_version": start + 3,
        "trainer_version": 1,
    }
    metrics = (await served.http.get("/metrics")).text
    assert f'rlserve_weight_lineage{{model="policy"}} {float(lineage + 1)}' in metrics
    await assert_serves(served, again[-1])
    async with asyncio.timeout(60):  # generation goes on, with the newest version
        _, _, meta = await slime_generate(served, PROMPTS[0], slime_sampling_params(3))
    assert meta["weight_version"] == "2"
    generated = await served.http.post("/v1/generate", json={"tokens": [[5, 6]], "max_tokens": 2})
    assert generated.json()["policy_version"] == start + 4


@pytest.mark.parametrize("steps", [2])
async def test_slimes_distributed_updates_serve_the_trainers_weights(
    served, trainer_model, tmp_path, steps
):
    for step in range(steps):
        new = perturbed(trainer_model, 1.05)
        version = await served_version(served) + 1
        await asyncio.to_thread(slime_distributed_update, served, new, version, tmp_path)
        assert await served_version(served) == version, f"step {step}"
        await assert_serves(served, new)


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    groups: list[tuple[list[int], list[list[int]], list[float]]],
) -> None:
    """One policy-gradient step on group-normalised advantages (prompt, replies, rewards)."""
    optimizer.zero_grad()
    loss = torch.zeros(())
    for prompt, replies, rewards in groups:
        mean = sum(rewards) / len(rewards)
        for reply, reward in zip(replies, rewards, strict=True):
            ids = torch.tensor([prompt + reply])
            logits = model(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            taken = logits.gather(-1, ids[0, len(prompt) :, None]).sum()
            loss = loss - (reward - mean) * taken
    loss.backward()
    optimizer.step()


async def test_a_three_step_grpo_loop_through_slimes_requests(served, trainer_model, tmp_path):
    """slime's loop: its first weight sync, then per step rollouts with its generate bodies, a
    policy-gradient step on the trainer and the new weights pushed with its distributed
    update. Each step samples with the weights pushed last: the log-probs slime reads back
    are the trainer's own forward of them (the importance ratio starts at 1)."""
    optimizer = torch.optim.Adam(trainer_model.parameters(), lr=1e-3)
    version = await served_version(served) + 1
    await asyncio.to_thread(slime_distributed_update, served, trainer_model, version, tmp_path)
    previous: list[float] | None = None
    for step in range(3):
        groups = []
        for prompt in PROMPTS:
            replies, rewards = [], []
            for seed in range(4):  # a group of four, as --n-samples-per-prompt
                params = slime_sampling_params(5, sampling_seed=100 * step + seed)
                tokens, log_probs, meta = await slime_generate(served, prompt, params)
                assert meta["weight_version"] == str(version)
                with torch.no_grad():
                    own = forward_log_probs(trainer_model, prompt + tokens)[len(prompt) :]
                assert_close(log_probs, own, 1e-4)
                replies.append(tokens)
                rewards.append(sum(t % 2 == 0 for t in tokens) / len(tokens))  # even ids
            groups.append((prompt, replies, rewards))
        grpo_step(trainer_model, optimizer, groups)
        version += 1
        await asyncio.to_thread(slime_distributed_update, served, trainer_model, version, tmp_path)
        assert await served_version(served) == version, f"step {step}"
        (scores,) = await served.scores([SEQUENCES[0]])
        assert previous is None or scores != previous  # the step changed the served weights
        previous = scores
    with torch.no_grad():
        await assert_serves(served, trainer_model)
