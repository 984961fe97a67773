"""The official `openai` SDK, sync and async, against a real rlserve process: chat and
completions, streaming (chunks arrive while the reply is generated; a client that goes away
frees its batch slot), the SDK's own errors, and a multi-turn agent whose recorded trajectory
the rlserve client turns into a TensorDict."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from tests.conftest import assert_close
from tests.e2e.server import Server, serving_here

pytestmark = pytest.mark.slow
CHAT = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    with serving_here(tmp_path_factory.mktemp("openai-e2e"), settings) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(server: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0) as client:
        yield client


def in_flight(server: Server) -> int:
    state = httpx.get(f"{server.url}/v1/serving").json()
    return int(state["in_flight_generations"])


def test_sync_and_async_clients_agree(server, sdk):
    params = {"model": "policy", "messages": CHAT, "max_tokens": 16, "n": 2, "seed": 9}
    sync_reply = sdk.chat.completions.create(**params)

    async def async_reply() -> object:
        async with AsyncOpenAI(base_url=f"{server.url}/v1", api_key="-") as client:
            return await client.chat.completions.create(**params)

    import asyncio

    other = asyncio.run(async_reply())
    assert [c.message.content for c in sync_reply.choices] == [
        c.message.content
        for c in other.choices  # type: ignore[attr-defined]
    ]
    completion = sdk.completions.create(model="policy", prompt="Once", max_tokens=8, seed=3)
    assert completion.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="policy", prompt="Once", max_tokens=10**9)
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("policy")  # no per-model route: the SDK's 404


def test_chunks_arrive_while_the_reply_is_generated(sdk):
    """The first content arrives long before the last token; then the same text as without
    streaming."""
    params = {"model": "policy", "messages": CHAT, "max_tokens": 400, "seed": 2}
    extra = {"ignore_eos": True}
    start = time.perf_counter()
    first, text = None, ""
    for chunk in sdk.chat.completions.create(stream=True, extra_body=extra, **params):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and first is None:
            first = time.perf_counter() - start
        text += piece or ""
    total = time.perf_counter() - start
    assert first is not None and first < total / 4, (first, total)
    reply = sdk.chat.completions.create(extra_body=extra, **params)
    assert text == reply.choices[0].message.content


def test_a_client_leaving_mid_stream_frees_its_slot(server, sdk):
    stream = sdk.chat.completions.create(
        model="policy",
        messages=CHAT,
        max_tokens=4000,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for seen, _chunk in enumerate(stream):
        if seen == 2:  # three chunks in
            break
    assert in_flight(server) == 1
    stream.close()
    deadline = time.monotonic() + 10
    while in_flight(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert in_flight(server) == 0


def agent_turns(sdk: OpenAI, opening: str, follow_up: str, *, max_tokens: int) -> str:
    """Three chat turns through the SDK under a new trajectory id (returned), each reply sent
    back in the next request's history with `follow_up` after it."""
    trajectory = uuid.uuid4().hex
    messages: list[dict[str, str]] = [{"role": "user", "content": opening}]
    for turn in range(3):
        reply = sdk.chat.completions.create(
            model="policy",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            seed=turn,
            extra_headers={"X-Trajectory-ID": trajectory},
        )
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": follow_up},
        ]
    return trajectory


def test_a_multi_turn_agent_becomes_a_training_sample(server, sdk):
    """An agent loop through the SDK with a trajectory id; the rlserve client reads the
    trajectory back as a TensorDict whose sampled log-probs equal /v1/logprobs."""
    from rlserve_client import Client

    trajectory = agent_turns(sdk, "Let's talk.", "Go on.", max_tokens=6)
    with Client(base_url=server.url) as client:
        client.set_trajectory_reward(trajectory, reward=2.0)
        recorded = client.trajectory(trajectory)
        assert recorded.num_turns == 3 and recorded.reward == 2.0
        td = recorded.to_tensordict()
        assert td.batch_size[0] == len(recorded.segments)
        for row, segment in zip(td.unbind(0), recorded.segments, strict=True):
            real = row["masks", "all_attention_mask"]
            tokens = row["tokens", "full"][real].tolist()
            mask = row["masks", "all_assistant_mask"][real].tolist()
            log_probs = row["log_probs", "full"][real].tolist()
            assert tokens == segment.tokens.full
            scored = client.logprobs(tokens=[tokens]).outputs[0].log_probs.full
            at = [i for i, m in enumerate(mask) if m]
            assert len(at) == sum(t.end - t.start for t in segment.turns)
            assert_close([log_probs[i] for i in at], [scored[i] for i in at], 1e-4)
