"""Anthropic's Messages API, driven by Anthropic's own SDK (`anthropic`, unmodified) against the
app: a tool-using conversation (sync, async and streamed) whose turns are one token-exact
trajectory, one session mixing the OpenAI and Anthropic SDKs as one trajectory, the token
count, and refusals in Anthropic's error shape. The model is scripted (`FakeBackend`): its
replies are known, so a tool call is sampled on cue."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from tests.fake.backend import FakeBackend, fake_app

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a test dependency")
httpx2 = pytest.importorskip("httpx2", reason="the anthropic SDK's HTTP client")


class LoopTransport(httpx2.BaseTransport):  # type: ignore[misc]
    """Synchronous requests (the sync SDK's, from another thread) served by the in-process
    app on `loop`."""

    def __init__(self, app: FastAPI, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = httpx2.ASGITransport(app=app)
        self.loop = loop

    def handle_request(self, request: Any) -> Any:
        async def send() -> Any:
            body = request.read()
            forwarded = httpx2.Request(
                request.method, request.url, headers=request.headers, content=body
            )
            response = await self.inner.handle_async_request(forwarded)
            content = await response.aread()
            return httpx2.Response(response.status_code, headers=response.headers, content=content)

        return asyncio.run_coroutine_threadsafe(send(), self.loop).result()


TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
]
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[FastAPI, FakeBackend]]:
    policy = FakeBackend("policy", lambda t: -0.5)
    async with fake_app(tmp_path, policy, FakeBackend("reference", lambda t: -0.5)) as app:
        yield app, policy


def sdk(app: FastAPI, **options: Any) -> anthropic.AsyncAnthropic:
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://rlserve")
    return anthropic.AsyncAnthropic(
        base_url="http://rlserve", api_key="-", http_client=http, max_retries=0, **options
    )


def tool_call_reply(policy: FakeBackend, arguments: str) -> list[int]:
    """The tokens of a turn that calls get_weather, exactly as the template renders such a
    turn (so the next turn's prompt holds them as sampled; this template takes arguments as
    an object, as the server gives them to it)."""
    tokenizer = policy.tokenizer
    call: dict[str, Any] = {"id": "call_x", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": json.loads(arguments)}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    template = tokenizer.apply_chat_template
    before = template(ASKED, tools=TOOLS_AS_OPENAI, add_generation_prompt=True, tokenize=False)
    after = template([*ASKED, turn], tools=TOOLS_AS_OPENAI, tokenize=False)
    assert after.startswith(before)
    end = tokenizer.eos_token
    reply = after[len(before) :]
    reply = reply[: reply.index(end) + len(end)] if end in reply else reply
    return list(tokenizer.encode(reply, add_special_tokens=False))


TOOLS_AS_OPENAI = [
    {
        "type": "function",
        "function": {
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["input_schema"],
        },
    }
    for tool in TOOLS
]


async def test_a_tool_using_conversation_is_one_exact_trajectory(
    served: tuple[FastAPI, FakeBackend],
) -> None:
    app, policy = served
    policy.reply = tool_call_reply(policy, '{"city": "Paris"}')
    trajectory = uuid.uuid4().hex
    headers = {"X-Trajectory-ID": trajectory}
    async with sdk(app) as client:
        first = await client.messages.create(
            model="policy", max_tokens=256, messages=ASKED, tools=TOOLS, extra_headers=headers
        )
        assert first.stop_reason == "tool_use" and first.role == "assistant"
        (use,) = [block for block in first.content if block.type == "tool_use"]
        assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
        assert first.usage.output_tokens == len(policy.reply)

        policy.reply = policy.tokenizer.encode("Sunny.", add_special_tokens=False)
        history = [
            *ASKED,
            {"role": "assistant", "content": [block.model_dump() for block in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21C"}],
            },
        ]
        second = await client.messages.create(
            model="policy", max_tokens=256, messages=history, tools=TOOLS, extra_headers=headers
        )
        assert second.stop_reason == "end_turn"
        assert [(b.type, getattr(b, "text", None)) for b in second.content] == [("text", "Sunny.")]

    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlserve")
    async with http:
        got = (await http.get(f"/v1/trajectories/{trajectory}")).json()
    assert got["num_turns"] == 2
    (segment,) = got["segments"]  # the tool call re-rendered as sampled: no break
    assert "break_reason" not in segment
    assert (
        sum(segment["masks"]["all_assistant_mask"]) == len(policy.reply) + first.usage.output_tokens
    )


async def test_a_streamed_message_is_the_message(served: tuple[FastAPI, FakeBackend]) -> None:
    app, policy = served
    policy.reply = tool_call_reply(policy, '{"city": "Paris"}')
    async with sdk(app) as client:
        whole = await client.messages.create(
            model="policy", max_tokens=256, messages=ASKED, tools=TOOLS
        )
        async with client.messages.stream(
            model="policy", max_tokens=256, messages=ASKED, tools=TOOLS
        ) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "message_delta" in kinds
    assert streamed.stop_reason == whole.stop_reason == "tool_use"
    strip = [{k: v for k, v in b.model_dump().items() if k != "id"} for b in streamed.content]
    assert strip == [{k: v for k, v in b.model_dump().items() if k != "id"} for b in whole.content]
    assert streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.usage.input_tokens == whole.usage.input_tokens

    policy.reply = policy.tokenizer.encode("Hello there. STOP more", add_special_tokens=False)
    async with (
        sdk(app) as client,
        client.messages.stream(
            model="policy", max_tokens=256, messages=ASKED, stop_sequences=[" STOP"]
        ) as stream,
    ):
        text = "".join([chunk async for chunk in stream.text_stream])
        stopped = await stream.get_final_message()
    assert text == "Hello there."
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", " STOP")


async def test_the_sync_client_and_the_token_count(served: tuple[FastAPI, FakeBackend]) -> None:
    app, policy = served
    loop = asyncio.get_running_loop()
    body = {"model": "policy", "messages": ASKED, "tools": TOOLS}

    def calls() -> tuple[Any, Any]:
        http = httpx2.Client(transport=LoopTransport(app, loop), base_url="http://rlserve")
        with anthropic.Anthropic(base_url="http://rlserve", api_key="-", http_client=http) as c:
            counted = c.messages.count_tokens(**body)
            message = c.messages.create(max_tokens=2, **body, extra_body={"return_token_ids": True})
            return counted, message

    counted, message = await asyncio.to_thread(calls)
    prompt = message.model_extra["prompt_token_ids"]
    assert counted.input_tokens == len(prompt) == message.usage.input_tokens
    assert message.model_extra["token_ids"] == policy.reply[:2]
    assert message.stop_reason == "max_tokens"


async def test_one_session_mixing_the_two_sdks_is_one_trajectory(
    served: tuple[FastAPI, FakeBackend],
) -> None:
    from openai import AsyncOpenAI

    app, _ = served
    trajectory = uuid.uuid4().hex
    headers = {"X-Trajectory-ID": trajectory}
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlserve")
    openai = AsyncOpenAI(base_url="http://rlserve/v1", api_key="-", http_client=http)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Count with me."}]
    async with sdk(app) as client, openai:
        for turn in range(3):
            if turn == 1:
                reply = await openai.chat.completions.create(
                    model="policy", messages=messages, max_tokens=16, extra_headers=headers
                )
                text = reply.choices[0].message.content
            else:
                message = await client.messages.create(
                    model="policy", max_tokens=16, messages=messages, extra_headers=headers
                )
                text = message.content[0].text
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"and {turn}?"},
            ]
        got = (await http.get(f"/v1/trajectories/{trajectory}")).json()
    assert got["num_turns"] == 3
    (segment,) = got["segments"]
    assert "break_reason" not in segment
    assert [t["turn"] for t in segment["turns"]] == [0, 1, 2]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"messages": ASKED}, 400, "max_tokens"),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
                        ],
                    }
                ],
            },
            400,
            "messages[0].content[0]: a image block",
        ),
        (
            {"max_tokens": 8, "messages": ASKED, "tools": TOOLS, "tool_choice": {"type": "any"}},
            400,
            "tool_choice",
        ),
        ({"max_tokens": 8, "messages": ASKED, "model": "nobody"}, 404, "'nobody' does not exist"),
    ],
)
async def test_refusals_are_in_anthropics_error_shape(
    served: tuple[FastAPI, FakeBackend], body: dict[str, Any], status: int, words: str
) -> None:
    app, _ = served
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlserve")
    async with http:
        answer = await http.post("/v1/messages", json={"model": "policy", **body})
    assert answer.status_code == status, answer.text
    error = answer.json()
    assert error["type"] == "error" and words in error["error"]["message"], error
    kinds = {400: "invalid_request_error", 404: "not_found_error"}
    assert error["error"]["type"] == kinds[status]
    if "max_tokens" not in body:
        return  # (the SDK itself refuses to send it)
    async with sdk(app) as client:
        errors = {400: anthropic.BadRequestError, 404: anthropic.NotFoundError}
        with pytest.raises(errors[status]) as raised:
            await client.messages.create(**{"model": "policy", **body})
    assert words in raised.value.message


async def test_keys_come_as_x_api_key(tmp_path: Path) -> None:
    from tests.envs.test_ownership import KEYS

    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair, auth={"api_keys": KEYS}) as app:
        async with sdk(app) as keyless:
            with pytest.raises(anthropic.AuthenticationError):
                await keyless.messages.create(model="policy", max_tokens=4, messages=ASKED)
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://r")
        keyed = anthropic.AsyncAnthropic(base_url="http://r", api_key=KEYS[0], http_client=http)
        async with keyed:
            message = await keyed.messages.create(model="policy", max_tokens=4, messages=ASKED)
        assert message.content[0].text == "Hi!"
        assert json.loads(message.model_dump_json())["type"] == "message"
