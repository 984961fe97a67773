"""Tokenizing, templating and decoding run on each model's tokenizer thread, never on the
event loop: a request with a large input cannot stall every other request."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio.to_thread
import httpx
import pytest

from app.common.inputs import InputPreparer
from tests.fake.backend import FakeBackend, fake_app


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/generate", {"text": ["hello there"], "max_new_tokens": 2}),
        ("/v1/logprobs", {"text": ["hello there"]}),
        ("/v1/kl", {"text": ["hello there"], "assistant_only": False}),
    ],
)
async def test_token_work_runs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any]
) -> None:
    threads: set[str] = set()
    for name in ("encode", "decode"):
        real = getattr(InputPreparer, name)

        def spy(self: InputPreparer, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            threads.add(threading.current_thread().name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(InputPreparer, name, spy)
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            answer = await client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    assert threads and all(t.startswith("tokenizer") for t in threads), threads


async def test_env_reset_and_step_tokenize_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Templating a conversation, encoding an action, decoding observations: none of it on
    the event loop's thread, for chat and token environments."""
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    calls: list[tuple[str, int]] = []
    loop_thread = threading.get_ident()
    async with fake_app(tmp_path, *pair) as app:
        tokenizer_class = type(app.state.registry.get("policy").preparer.tokenizer)
        # (Decoding goes to the fast tokenizer's own Rust object where transformers would add
        # nothing: it is watched where the service calls it.)
        watched = [(tokenizer_class, n) for n in ("__call__", "encode", "apply_chat_template")]
        for owner, name in [*watched, (InputPreparer, "decode")]:
            real = getattr(owner, name)

            def spy(self: Any, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
                calls.append((_name, threading.get_ident()))
                return _real(self, *args, **kw)

            monkeypatch.setattr(owner, name, spy)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            for kind, prompts, action in [
                ("chat", {"query": ["What is 2+2?"]}, {"text": "It is 4."}),
                ("tokens", {"tokens": [[5, 6]]}, {"tokens": [7, 8]}),
            ]:
                made = await client.post("/v1/envs", json={"kind": kind, "max_turns": 2})
                env_id = made.json()["env_id"]
                reset = await client.post(f"/v1/envs/{env_id}/reset", json=prompts)
                assert reset.status_code == 200, reset.text
                step = await client.post(f"/v1/envs/{env_id}/step", json={"actions": [action]})
                assert step.status_code == 200, step.text
    assert {"__call__", "decode", "apply_chat_template"} <= {name for name, _ in calls}, calls
    on_loop = [name for name, thread in calls if thread == loop_thread]
    assert not on_loop, on_loop


async def test_requests_hand_nothing_to_the_generic_thread_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routes and their dependencies are coroutines: FastAPI runs a plain function in its
    thread pool, a hand-off to a thread and back per call on every request. Work that belongs
    off the loop goes to the service's own threads (tokenizer, store, model)."""
    handed: list[str] = []
    real = anyio.to_thread.run_sync

    async def spy(func: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(getattr(func, "__qualname__", repr(func)))
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(anyio.to_thread, "run_sync", spy)
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            kl = {"text": ["hello there"], "assistant_only": False}
            answers = [
                await client.post("/v1/generate", json={"text": ["hi"], "max_new_tokens": 2}),
                await client.post("/v1/logprobs", json={"text": ["hello there"]}),
                await client.post("/v1/kl", json=kl),
                await client.get("/health"),
                made := await client.post("/v1/envs", json={"kind": "chat", "max_turns": 4}),
            ]
            env = made.json()["env_id"]
            answers += [
                await client.post(f"/v1/envs/{env}/reset", json={"query": ["What is 2+2?"]}),
                await client.post(f"/v1/envs/{env}/step", json={"actions": [{"text": "4"}]}),
                await client.get(f"/v1/envs/{env}"),
            ]
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 201, 200, 200, 200], [
        a.text for a in answers
    ]
    assert handed == [], handed


@pytest.mark.parametrize(
    ("config", "trips"),
    [
        ({"kind": "chat"}, 1),  # check, apply and observe in one trip
        ({"kind": "tokens"}, 1),
        ({"kind": "chat", "kl": {"coeff": 0.5}}, 2),  # the KL scoring call comes between
    ],
)
async def test_a_step_with_nothing_to_wait_for_takes_one_trip_to_the_tokenizer_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any], trips: int
) -> None:
    """Each trip to a thread and back costs a hand-off of the GIL both ways, as much as the
    work of a short step; a step without tools or a KL penalty waits on nothing between
    checking its actions and observing the rows."""
    counted: list[str] = []
    real = InputPreparer.off_loop

    async def spy(self: InputPreparer, fn: Any, *args: Any, **kwargs: Any) -> Any:
        counted.append(fn.__name__)
        return await real(self, fn, *args, **kwargs)

    monkeypatch.setattr(InputPreparer, "off_loop", spy)
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    prompts = {"tokens": [[5, 6]]} if config["kind"] == "tokens" else {"query": ["2+2?"]}
    action = {"tokens": [7, 8]} if config["kind"] == "tokens" else {"text": "4"}
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            env = (await client.post("/v1/envs", json={**config, "max_turns": 4})).json()["env_id"]
            assert (await client.post(f"/v1/envs/{env}/reset", json=prompts)).status_code == 200
            counted.clear()
            step = await client.post(f"/v1/envs/{env}/step", json={"actions": [action]})
    assert step.status_code == 200, step.text
    assert len(counted) == trips, counted
    if "kl" in config:  # the penalty was applied between the trips
        assert step.json()["outputs"][0]["info"]["reward"]["kl_penalty"] != 0.0
