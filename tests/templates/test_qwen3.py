"""Qwen3's real chat template through the OpenAI routes: prompts token-exact with its own
tokenizer's rendering (thinking on and off, tools, a multi-turn history with reasoning and tool
calls), the reasoning parser on what a real Qwen3 architecture samples, and a scripted Qwen3
reply whose reasoning, answer and tool call, sent back as the reply gave them (through the chat
route and through Anthropic's Messages API), render the very tokens that were sampled."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from app.config import Settings
from app.main import create_app
from tests.conftest import started
from tests.fake.backend import FakeBackend, fake_app

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
# What a Qwen3 writes when it thinks, then calls a tool: the arguments' spacing is its own
# (json.dumps would write {"a": 2, "b": 3}).
WRITTEN = (
    "<think>\nI should add them.\n</think>\n\nLet me add.\n<tool_call>\n"
    '{"name": "add", "arguments": {"a":2,  "b": 3}}\n</tool_call>'
)


@pytest.fixture(scope="module")
async def qwen3(qwen3_model_dir: Path, cache_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        models={
            "model": str(qwen3_model_dir),
            "load_reference": False,
            "backend": "transformers",
            "cache_dir": cache_dir,
            "reasoning_parser": "qwen3",
        },
        storage={"data_dir": cache_dir / "qwen3-data"},
    )
    app: FastAPI = create_app(settings)
    async with app.router.lifespan_context(app):
        await started(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://q") as client:
            yield client


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/chat/completions", json={"model": "policy", **body})
    assert response.status_code == 200, response.text
    return response.json()


async def stream(client: httpx.AsyncClient, **body: Any) -> list[dict[str, Any]]:
    body = {"model": "policy", "stream": True, **body}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: ") :]) for line in lines[:-1]]


def history_with_a_call() -> list[dict[str, Any]]:
    return [
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let me add.",
            "reasoning_content": "I should add them.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


@pytest.mark.parametrize(
    ("messages", "kwargs", "tools"),
    [
        (QUESTION, {}, None),
        (QUESTION, {"enable_thinking": False}, None),
        (QUESTION, {}, TOOLS),
        (history_with_a_call(), {}, TOOLS),
        (history_with_a_call(), {"enable_thinking": False}, TOOLS),
    ],
    ids=["plain", "no-thinking", "tools", "history", "history-no-thinking"],
)
async def test_prompts_are_qwen3s_own_rendering(qwen3, qwen3_tokenizer, messages, kwargs, tools):
    expected = qwen3_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
    )
    expected_ids = qwen3_tokenizer(expected, add_special_tokens=False)["input_ids"]
    body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "return_token_ids": True}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if tools:
        body["tools"] = tools
    reply = await chat(qwen3, **body)
    assert reply["prompt_token_ids"] == expected_ids
    tokenized = await qwen3.post("/tokenize", json={"model": "policy", **body})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == expected_ids


def split(text: str) -> tuple[str | None, str | None]:
    """Qwen3's rule, written out: a reply that opens with <think> reasons until </think>
    (all of it, if it never closes); any other reply is all answer."""
    head = text.lstrip()
    if not head.startswith("<think>"):
        return None, text or None
    reasoning, closed, answer = head[len("<think>") :].partition("</think>")
    return reasoning, (answer or None) if closed else None


async def test_sampled_replies_split_into_reasoning_and_answer(qwen3, qwen3_tokenizer):
    # A random Qwen3 restricted to a few tokens, the thinking tags among them, writes replies
    # that open and close its reasoning at random.
    vocabulary = ["<think>", "</think>", "Hello", " world", "\n"]
    allowed = qwen3_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    allowed += [qwen3_tokenizer.encode(w)[0] for w in vocabulary[2:]]
    seen = set()
    for seed in range(12):
        body = {
            "messages": QUESTION,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": seed,
            "allowed_token_ids": allowed,
            "return_token_ids": True,
        }
        whole = await chat(qwen3, **body)
        (choice,) = whole["choices"]
        text = qwen3_tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
        reasoning, answer = split(text)
        seen.add((reasoning is not None, answer is not None))
        message = choice["message"]
        assert message.get("reasoning") == message.get("reasoning_content") == (reasoning or None)
        assert message.get("content") == answer
        # the stream's deltas add up to the same reply
        chunks = await stream(qwen3, **body)
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning", "") for d in deltas) == (reasoning or "")
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
        assert "".join(d.get("content") or "" for d in deltas) == (answer or "")
        # SGLang's separate_reasoning: false leaves the text whole; vLLM's include_reasoning:
        # false leaves the reasoning out
        whole_text = await chat(qwen3, **body, separate_reasoning=False)
        assert whole_text["choices"][0]["message"].get("content") == (text or None)
        assert whole_text["choices"][0]["message"]["reasoning"] is None  # (null, as vLLM sends)
        hidden = await chat(qwen3, **body, include_reasoning=False)
        assert hidden["choices"][0]["message"]["reasoning"] is None
        assert hidden["choices"][0]["message"].get("content") == answer
    # replies that only think, that think then answer, and that only answer all came up
    assert {(True, False), (True, True), (False, True)} <= seen, seen


@pytest.fixture
async def scripted(
    tmp_path: Path, qwen3_tokenizer: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, list[int]]]:
    """The service on a model that writes WRITTEN and its end of turn, with Qwen3's tokenizer."""
    reply = qwen3_tokenizer(WRITTEN, add_special_tokens=False)["input_ids"]
    reply.append(qwen3_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    models = [
        FakeBackend(name, lambda t: -1.0, reply=reply, tokenizer=qwen3_tokenizer)
        for name in ("policy", "reference")
    ]
    async with fake_app(tmp_path, *models, models={"reasoning_parser": "qwen3"}) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            yield client, reply


async def test_a_reply_sent_back_renders_the_tokens_it_sampled(scripted, qwen3_tokenizer):
    client, sampled = scripted
    body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 64, "return_token_ids": True}
    reply = await chat(client, **body)
    (choice,) = reply["choices"]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "\nI should add them.\n"
    assert message["content"] == "Let me add."
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a":2,  "b": 3}'}  # as written
    assert choice["finish_reason"] == "tool_calls"
    assert choice["token_ids"] == sampled
    # The next turn, with the assistant message exactly as the reply gave it: its prompt
    # goes on from the first prompt and every sampled token.
    turn = {k: message[k] for k in ("role", "content", "reasoning_content", "tool_calls")}
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
    messages = [*QUESTION, turn, tool]
    following = await chat(client, **{**body, "messages": messages})
    prompt = reply["prompt_token_ids"]
    assert following["prompt_token_ids"][: len(prompt) + len(sampled)] == prompt + sampled
    # vLLM's name for the reasoning, sent back, renders the same
    renamed = {**turn, "reasoning": turn.pop("reasoning_content")}
    again = await chat(client, **{**body, "messages": [*QUESTION, renamed, tool]})
    assert again["prompt_token_ids"] == following["prompt_token_ids"]


async def test_a_streamed_call_gives_the_same_reasoning_answer_and_arguments(scripted):
    client, _ = scripted
    chunks = await stream(client, messages=QUESTION, tools=TOOLS, max_tokens=64)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nI should add them.\n"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me add."
    (call,) = [c for d in deltas for c in d.get("tool_calls") or []]
    assert call["function"] == {"name": "add", "arguments": '{"a":2,  "b": 3}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


ANSWERED = [*QUESTION, {"role": "assistant", "content": "5", "reasoning_content": "Two and three."}]


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["plain", "no-thinking"])
async def test_generate_and_logprobs_template_as_the_chat_route(qwen3, qwen3_tokenizer, kwargs):
    """rlserve's own routes take what the chat route takes: chat_template_kwargs, and an
    assistant turn's reasoning_content, rendered as Qwen3's own template renders them."""

    def ids(messages: list[dict[str, Any]], prompt: bool) -> list[int]:
        text = qwen3_tokenizer.apply_chat_template(
            messages, add_generation_prompt=prompt, tokenize=False, **kwargs
        )
        return qwen3_tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[no-any-return]

    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    body = {"messages": [QUESTION], "max_new_tokens": 1, **extra}
    generated = await qwen3.post("/v1/generate", json=body)
    assert generated.status_code == 200, generated.text
    assert generated.json()["outputs"][0][0]["tokens"]["prompt"] == ids(QUESTION, True)
    scored = await qwen3.post("/v1/logprobs", json={"messages": [ANSWERED], **extra})
    assert scored.status_code == 200, scored.text
    tokens = scored.json()["outputs"][0]["tokens"]
    whole = ids(ANSWERED, False)
    assert tokens["full"] == whole
    assert qwen3_tokenizer.decode(whole).count("Two and three.") == 1  # the reasoning rendered
    # The assistant's turn, its reasoning included, is the assistant's: from after its
    # header to its end-of-turn token.
    header = qwen3_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    start = max(k for k in range(len(whole)) if whole[k : k + len(header)] == header)
    mask = scored.json()["outputs"][0]["masks"]["all_assistant_mask"]
    assert mask == [0] * (start + len(header)) + [1] * (len(whole) - start - len(header) - 1) + [0]


async def test_a_messages_api_turn_sent_back_renders_the_tokens_it_sampled(scripted):
    """The same reply through Anthropic's Messages API: thinking, text and tool_use blocks,
    sent back as they came with the tool's result, render the sampled tokens (the arguments'
    own spacing included), so the session's trajectory is one segment."""
    client, sampled = scripted
    tools = [{**f["function"], "input_schema": f["function"]["parameters"]} for f in TOOLS]
    for tool in tools:
        del tool["parameters"]
    headers = {"X-Trajectory-ID": "qwen3-agent"}
    body = {"model": "policy", "max_tokens": 64, "system": "Be brief.", "tools": tools}
    asked = [{"role": "user", "content": "2+3?"}]
    first = await client.post("/v1/messages", json={**body, "messages": asked}, headers=headers)
    assert first.status_code == 200, first.text
    reply = first.json()
    assert [b["type"] for b in reply["content"]] == ["thinking", "text", "tool_use"]
    thinking, text, use = reply["content"]
    assert thinking["thinking"] == "\nI should add them.\n" and text["text"] == "Let me add."
    assert (use["name"], use["input"]) == ("add", {"a": 2, "b": 3})
    assert reply["stop_reason"] == "tool_use"
    result = {"type": "tool_result", "tool_use_id": use["id"], "content": "5"}
    history = [*asked, {"role": "assistant", "content": reply["content"]}]
    history.append({"role": "user", "content": [result]})
    second = await client.post("/v1/messages", json={**body, "messages": history}, headers=headers)
    assert second.status_code == 200, second.text
    got = (await client.get("/v1/trajectories/qwen3-agent")).json()
    assert got["num_turns"] == 2
    (segment,) = got["segments"]
    assert "break_reason" not in segment
    # The first reply's tokens sit in the one sequence as sampled, the assistant's.
    tokens, mask = segment["tokens"]["full"], segment["masks"]["all_assistant_mask"]
    start = next(i for i in range(len(tokens)) if tokens[i : i + len(sampled)] == sampled)
    assert all(mask[start : start + len(sampled)])
    assert sum(mask) == 2 * len(sampled)
