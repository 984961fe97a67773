"""Pause and resume: what in-flight work meets in each mode, that new requests wait rather than
fail, and that a generation running across an update accounts for every token with the weights
that produced it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.conftest import assert_close, forward_log_probs
from tests.weights.conftest import Served, perturbed
from tests.weights.test_transfer import send

PROMPT = [5, 17, 33, 2, 90]
LONG = {"tokens": [PROMPT], "max_new_tokens": 3000, "ignore_eos": True, "seed": 7}


async def in_flight(
    served: Served, body: dict[str, Any], route: str = "/v1/generate"
) -> asyncio.Task[Any]:
    """Start a request and return once the server counts it as in flight."""
    task = asyncio.create_task(served.http.post(route, json=body))
    for _ in range(400):
        state = (await served.http.get("/v1/serving")).json()
        if state["in_flight_generations"]:
            await asyncio.sleep(0.1)  # a few tokens in
            return task
        await asyncio.sleep(0.01)
    raise AssertionError("the generation never started")


async def test_a_generation_across_an_update_keeps_every_token(served, trainer_model):
    await asyncio.to_thread(send, served, trainer_model)
    old = perturbed(trainer_model, 1.0)
    new_state = {k: v * 0.7 for k, v in old.state_dict().items()}
    before = int((await served.http.get("/v1/weights/version")).json()["policy_version"])
    generation = await in_flight(served, LONG)
    result = await asyncio.to_thread(send, served, new_state)
    response = await generation
    assert response.status_code == 200, response.text
    body = response.json()
    (sample,) = body["outputs"][0]
    tokens = sample["tokens"]["response"]
    assert len(tokens) == LONG["max_new_tokens"] and sample["finish_reason"] == "length"
    assert body["policy_version"] == before
    spans = sample["policy_versions"]
    assert [s["version"] for s in spans] == [before, result.policy_version], spans
    k = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1] == {"version": before + 1, "start": k, "end": 3000}
    assert 0 < k < 3000
    full = PROMPT + tokens
    got = sample["log_probs"]["response"]
    on_old = forward_log_probs(old, full)[len(PROMPT) :]
    old.load_state_dict(new_state)
    on_new = forward_log_probs(old, full)[len(PROMPT) :]
    assert_close(got[:k], on_old[:k], 1e-4)
    assert_close(got[k:], on_new[k:], 1e-4)


async def test_a_rollout_turn_across_an_update_reports_both_versions(served, trainer_model):
    before = int((await served.http.get("/v1/weights/version")).json()["policy_version"])
    body = {
        "env": {"dataset": "arithmetic", "batch_size": 1, "max_turns": 1},
        "num_episodes": 1,
        "generation": {"max_new_tokens": 3000, "ignore_eos": True, "seed": 3},
    }
    rollout = await in_flight(served, body, "/v1/rollouts")
    result = await asyncio.to_thread(send, served, perturbed(trainer_model, 0.9))
    response = await rollout
    assert response.status_code == 200, response.text
    ((step,),) = [t["steps"] for t in response.json()["trajectories"]]
    spans = step["policy_versions"]
    assert [s["version"] for s in spans] == [before, result.policy_version] == [before, before + 1]
    assert step["policy_version"] == before
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"]
    assert spans[1]["end"] == len(step["tokens"]["response"]) == 3000


async def test_abort_ends_generations_and_holds_new_requests(served):
    generation = await in_flight(served, LONG)
    paused = (await served.http.post("/v1/pause", json={"mode": "abort"})).json()
    assert paused["paused"] and paused["mode"] == "abort" and paused["paused_by"] == "request"
    response = await generation
    (sample,) = response.json()["outputs"][0]
    assert sample["finish_reason"] == "abort"
    assert 0 < len(sample["tokens"]["response"]) < LONG["max_new_tokens"]
    ready = (await served.http.get("/ready")).json()
    assert ready["paused"] and ready["pause_mode"] == "abort"
    metrics = (await served.http.get("/metrics")).text
    assert 'rlserve_serving_paused{mode="abort"} 1.0' in metrics
    held = asyncio.create_task(served.scores([[5, 6, 7]]))
    await asyncio.sleep(0.3)
    assert not held.done()
    assert (await served.http.get("/v1/serving")).json()["waiting"] == 1
    conflict = await served.http.post("/v1/pause", json={"mode": "keep"})
    assert conflict.status_code == 409 and conflict.json()["error"]["param"] == "mode"
    resumed = (await served.http.post("/v1/resume")).json()
    assert not resumed["paused"]
    assert len((await held)[0]) == 3
    assert 'rlserve_serving_paused{mode="abort"} 0.0' in (await served.http.get("/metrics")).text


async def test_wait_lets_in_flight_work_finish(served):
    short = {"tokens": [PROMPT], "max_new_tokens": 300, "ignore_eos": True, "seed": 1}
    generation = await in_flight(served, short)
    paused = (await served.http.post("/v1/pause", json={"mode": "wait"})).json()
    try:
        # The generation left the gate before the pause returned (its HTTP answer may still
        # be on its way), and it ran to its end rather than being cut.
        assert paused["in_flight_generations"] == 0
        (sample,) = (await generation).json()["outputs"][0]
        assert sample["finish_reason"] == "length" and len(sample["tokens"]["response"]) == 300
        held = asyncio.create_task(served.http.post("/v1/generate", json=short))
        await asyncio.sleep(0.3)
        assert not held.done()
    finally:
        await served.http.post("/v1/resume")
    assert (await held).status_code == 200


@pytest.mark.parametrize("mode", ["keep", "wait"])
async def test_pausing_twice_with_one_mode_is_harmless(served, mode):
    for _ in range(2):
        assert (await served.http.post("/v1/pause", json={"mode": mode})).json()["paused"]
    assert not (await served.http.post("/v1/resume")).json()["paused"]
    assert not (await served.http.post("/v1/resume")).json()["paused"]


async def aborted_while_asking_for_extras(
    http: Any, max_new_tokens: int = 3000, *, keeps_tokens: bool = True
) -> None:
    """An abort pause ends a long generation that asks for top_logprobs, and returns: it does
    not wait for the aborted row's extras (a paused vLLM engine would score them only after
    the resume, which the pause itself holds up). The row keeps the tokens it produced, except
    where vLLM's processed mode scores it once more for its raw values."""
    body = {**LONG, "max_new_tokens": max_new_tokens, "top_logprobs": 2}
    task = asyncio.create_task(http.post("/v1/generate", json=body))
    for _ in range(400):
        if (await http.get("/v1/serving")).json()["in_flight_generations"]:
            break
        await asyncio.sleep(0.01)
    else:
        raise AssertionError(f"the generation never started: {(await task).text}")
    await asyncio.sleep(0.1)
    try:
        paused = await asyncio.wait_for(http.post("/v1/pause", json={"mode": "abort"}), 60)
        assert paused.json()["paused"] and paused.json()["in_flight_generations"] == 0
        (sample,) = (await asyncio.wait_for(task, 60)).json()["outputs"][0]
        assert sample["finish_reason"] == "abort"
        assert len(sample["tokens"]["response"]) > 0 or not keeps_tokens
        assert len(sample["tokens"]["response"]) < max_new_tokens
        assert sample.get("top_logprobs") is None
    finally:
        await http.post("/v1/resume")
    again = (await http.post("/v1/generate", json={**body, "max_new_tokens": 4})).json()
    (sample,) = again["outputs"][0]
    assert sample["finish_reason"] == "length" and len(sample["top_logprobs"]["ids"]) == 4


async def test_abort_does_not_wait_for_an_aborted_rows_extras(served):
    await aborted_while_asking_for_extras(served.http)


async def test_a_request_waits_for_a_pause_only_so_long(served):
    """Past limits.paused_wait_s, a request waiting on a pause is refused: a 503 to retry
    (Retry-After) naming the setting, nothing started; the same request is served after the
    resume. A request the pause froze mid-way is not refused: it goes on at the resume."""
    gate = served.app.state.registry.gate
    bound, gate.paused_wait_s = gate.paused_wait_s, 0.5
    body = {"tokens": [PROMPT], "max_new_tokens": 4, "seed": 3}
    try:
        frozen = await in_flight(served, {**LONG, "max_new_tokens": 200})
        await served.http.post("/v1/pause", json={"mode": "keep"})
        for route, request in (("/v1/generate", body), ("/v1/logprobs", {"tokens": [PROMPT]})):
            refused = await served.http.post(route, json=request)
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "5"
            error = refused.json()["error"]
            assert error["type"] == "unavailable_error"
            assert "RLSERVE_LIMITS__PAUSED_WAIT_S" in error["message"]
        state = (await served.http.get("/v1/serving")).json()
        assert state["waiting"] == 0 and state["in_flight_generations"] == 1
        await asyncio.sleep(1.0)
        assert not frozen.done()  # past the bound, and still held, not refused
    finally:
        gate.paused_wait_s = bound
        await served.http.post("/v1/resume")
    (sample,) = (await frozen).json()["outputs"][0]
    assert len(sample["tokens"]["response"]) == 200
    again = await served.http.post("/v1/generate", json=body)
    assert again.status_code == 200, again.text
