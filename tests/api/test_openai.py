"""The OpenAI-compatible routes through the official `openai` SDK (in-process), on both
backends: the same tokens and log-probs as /v1/generate for the same seed, OpenAI's shapes,
stop strings, streaming that adds up to the non-streamed reply, and the SDK's own errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.conftest import assert_close

CHAT = [{"role": "user", "content": "What is 6*7?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluates arithmetic.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


@pytest.fixture
async def sdk(app) -> AsyncIterator[AsyncOpenAI]:  # type: ignore[no-untyped-def]
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rlserve")
    async with AsyncOpenAI(base_url="http://rlserve/v1", api_key="-", http_client=http) as client:
        yield client


async def generate(client: httpx.AsyncClient, **body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post("/v1/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_models_list_in_openai_shape(sdk, client):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == ["policy", "reference"]
    assert all(m.object == "model" and m.owned_by == "rlserve" for m in models.data)
    ours = (await client.get("/v1/models")).json()
    assert ours["models"] == ours["data"] and ours["policy_version"] == 0


async def test_chat_samples_what_generate_samples(sdk, client):
    """Same seed, same tokens and raw log-probs as /v1/generate's messages path; n choices."""
    reply = await sdk.chat.completions.create(
        model="policy",
        messages=CHAT,
        max_tokens=12,
        n=3,
        seed=21,
        logprobs=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    body = await generate(
        client,
        messages=[CHAT],
        max_tokens=12,
        n=3,
        seed=21,
        ignore_eos=True,
        skip_special_tokens=True,  # as OpenAI's content
    )
    expected = body["outputs"][0]
    assert reply.object == "chat.completion" and len(reply.choices) == 3
    extra = reply.model_extra or {}
    assert extra["prompt_token_ids"] == expected[0]["tokens"]["prompt"]
    assert extra["policy_version"] == body["policy_version"]
    for choice, sample in zip(reply.choices, expected, strict=True):
        choice_extra = choice.model_extra or {}
        assert choice_extra["token_ids"] == sample["tokens"]["response"]
        lps = [entry.logprob for entry in choice.logprobs.content]
        assert_close(lps, sample["log_probs"]["response"], 1e-5)
        assert choice.message.content == sample["text"]["response"]
        assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(expected[0]["tokens"]["prompt"])
    assert reply.usage.completion_tokens == 36


async def test_processed_log_probs_and_top_logprobs(sdk, client, hf_tokenizer):
    reply = await sdk.chat.completions.create(
        model="policy",
        messages=CHAT,
        max_tokens=6,
        seed=5,
        temperature=0.7,
        logprobs=True,
        top_logprobs=3,
        extra_body={"logprobs_mode": "processed", "ignore_eos": True},
    )
    body = await generate(
        client,
        messages=[CHAT],
        max_tokens=6,
        seed=5,
        temperature=0.7,
        top_logprobs=3,
        ignore_eos=True,
    )
    sample = body["outputs"][0][0]
    entries = reply.choices[0].logprobs.content
    assert_close([e.logprob for e in entries], sample["log_probs"]["response_processed"], 1e-5)
    for entry, ids, values in zip(
        entries, sample["top_logprobs"]["ids"], sample["top_logprobs"]["log_probs"], strict=True
    ):
        expected = [[i] if i < 256 else list(hf_tokenizer.decode([i]).encode()) for i in ids]
        assert [t.bytes for t in entry.top_logprobs] == expected  # ids below 256 are bytes
        assert_close([t.logprob for t in entry.top_logprobs], values, 1e-5)


async def test_stop_strings_end_the_content(sdk, client):
    """The content stops before the stop string (OpenAI's rule); token_ids keep every
    sampled token, so the trajectory stays exact."""
    for seed in range(32):  # a seed whose reply has a printable ASCII character past its start
        free = await sdk.completions.create(model="policy", prompt="ab", max_tokens=24, seed=seed)
        text = free.choices[0].text
        stop = next((c for c in text[1:] if c.isascii() and c.isprintable()), None)
        if stop is not None:
            break
    assert stop is not None
    reply = await sdk.completions.create(
        model="policy",
        prompt="ab",
        max_tokens=24,
        seed=seed,
        stop=[stop],
        extra_body={"return_token_ids": True},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.text == text[: text.index(stop)]
    body = await generate(client, text=["ab"], max_tokens=24, seed=seed, stop=[stop])
    assert (choice.model_extra or {})["token_ids"] == body["outputs"][0][0]["tokens"]["response"]
    assert body["outputs"][0][0]["text"]["response"].endswith(stop)


async def test_completions_of_text_and_token_prompts(sdk, client):
    reply = await sdk.completions.create(
        model="policy", prompt=["ab", "xyz"], max_tokens=5, n=2, seed=2, logprobs=2
    )
    assert reply.object == "text_completion" and len(reply.choices) == 4
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    body = await generate(client, text=["ab", "xyz"], max_tokens=5, n=2, seed=2)
    samples = [s for group in body["outputs"] for s in group]
    for choice, sample in zip(reply.choices, samples, strict=True):
        assert_close(choice.logprobs.token_logprobs, sample["log_probs"]["response"], 1e-5)
        assert len(choice.logprobs.top_logprobs) == 5
        assert all(len(row) <= 2 for row in choice.logprobs.top_logprobs)
    tokens = await sdk.completions.create(model="policy", prompt=[97, 98], max_tokens=5, seed=2)
    assert tokens.choices[0].text == reply.choices[0].text  # "ab" is bytes 97, 98


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_streamed_chunks_add_up_to_the_reply(sdk, kind):
    """With the same seed, the concatenated deltas equal the non-streamed text, stop strings
    and unfinished characters included; every chunk carries the policy version."""
    params = {"model": "policy", "max_tokens": 40, "n": 2, "seed": 13, "stop": ["a", "e"]}
    if kind == "chat":
        reply = await sdk.chat.completions.create(messages=CHAT, **params)
        expected = [c.message.content for c in reply.choices]
        stream = await sdk.chat.completions.create(
            messages=CHAT, stream=True, stream_options={"include_usage": True}, **params
        )
    else:
        reply = await sdk.completions.create(prompt="hello", **params)
        expected = [c.text for c in reply.choices]
        stream = await sdk.completions.create(
            prompt="hello", stream=True, stream_options={"include_usage": True}, **params
        )
    texts, finishes, usage, versions = ["", ""], [None, None], None, set()
    async for chunk in stream:
        versions.add((chunk.model_extra or {}).get("policy_version"))
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            texts[choice.index] += piece or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == expected
    assert finishes == [c.finish_reason for c in reply.choices]
    assert usage == reply.usage
    assert versions == {0}


async def test_errors_are_the_sdks_exceptions(sdk):
    with pytest.raises(openai.NotFoundError, match="nope"):
        await sdk.chat.completions.create(model="nope", messages=CHAT)
    bad = [
        ({"temperature": -1}, "temperature"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"not-an-id": 1.0}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1.0}}, "logit_bias"),
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"logprobs": True, "top_logprobs": 2, "stream": True}, "top_logprobs"),
        ({"n": 2, "extra_body": {"trajectory_id": "t"}}, "n"),
        ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"extra_body": {"use_beam_search": True}}, "use_beam_search"),  # not silently sampled
    ]
    for params, field in bad:
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.chat.completions.create(model="policy", messages=CHAT, **params)
        assert caught.value.body["param"] == field, (params, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.completions.create(model="policy", prompt="x", extra_body={"use_beam_search": 1})
    assert caught.value.body["param"] == "use_beam_search"
    with pytest.raises(openai.BadRequestError) as caught:
        await sdk.completions.create(model="policy", prompt="x", echo=True, stream=True)
    assert caught.value.body["param"] == "echo"
    # A field rlserve does not know is ignored (and logged), as vLLM's server ignores it.
    reply = await sdk.chat.completions.create(
        model="policy", messages=CHAT, max_tokens=1, extra_body={"nvext": {"x": 1}}
    )
    assert len(reply.choices) == 1


async def test_processed_log_probs_need_an_engine_that_reports_them(tmp_path):
    """An engine that reports raw log-probs only (here the fake pair; vLLM in its default
    mode) refuses logprobs_mode processed, naming the field, and serves raw ones."""
    from tests.fake.backend import FakeBackend, fake_app

    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
    async with fake_app(tmp_path, *pair) as app:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://f")
        async with AsyncOpenAI(base_url="http://f/v1", api_key="-", http_client=http) as sdk:
            with pytest.raises(openai.BadRequestError) as caught:
                await sdk.chat.completions.create(
                    model="policy",
                    messages=CHAT,
                    logprobs=True,
                    extra_body={"logprobs_mode": "processed"},
                )
            assert caught.value.body["param"] == "logprobs_mode"
            reply = await sdk.chat.completions.create(model="policy", messages=CHAT, logprobs=True)
            assert [e.logprob for e in reply.choices[0].logprobs.content] == [-0.5] * 3


async def test_tools_are_templated_and_calls_in_history_are_accepted(sdk, hf_tokenizer):
    history = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]
    reply = await sdk.chat.completions.create(
        model="policy",
        messages=history,
        tools=TOOLS,
        max_tokens=4,
        seed=1,
        extra_body={"return_token_ids": True},
    )
    prompt = hf_tokenizer.decode((reply.model_extra or {})["prompt_token_ids"])
    assert '"name": "calculator"' in prompt and "Evaluates arithmetic." in prompt
    assert (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
        in prompt
    )
    assert "<|im_start|>tool\n42<|im_end|>" in prompt
    none = await sdk.chat.completions.create(
        model="policy",
        messages=CHAT,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    assert "calculator" not in hf_tokenizer.decode((none.model_extra or {})["prompt_token_ids"])
    # a streamed reply with tools is held to the end and equals the non-streamed one
    stream = await sdk.chat.completions.create(
        model="policy",
        messages=history,
        tools=TOOLS,
        max_tokens=4,
        seed=1,
        stream=True,
        extra_body={"return_token_ids": True},
    )
    chunks = [c async for c in stream if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert content == reply.choices[0].message.content
    ids = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids == (reply.choices[0].model_extra or {})["token_ids"]


def test_tool_calls_are_parsed_from_hermes_blocks():
    from app.dialects.openai.tools import parse_tool_calls

    names = {"calculator", "search"}
    text = (
        'Let me check. <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
        '</tool_call><tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text, names)
    assert content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("calculator", '{"expression": "1+1"}'),
        ("search", '{"q": 1}'),
    ]
    assert len({c.id for c in calls}) == 2
    for kept in (
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        "<tool_call>not json</tool_call>",
        "no call at all",
    ):
        assert parse_tool_calls(kept, names) == (kept, [])
    only, calls = parse_tool_calls('<tool_call>{"name": "search"}</tool_call>', names)
    assert only is None and calls[0].function.arguments == "{}"


async def test_events_are_ascii_lines(client):
    """Each event is one `data:` line of ASCII JSON, so clients that split lines on U+2028 or
    NEL (as str.splitlines does) still read whole events; the stream ends with [DONE]."""
    body = {"model": "policy", "prompt": "x", "max_tokens": 64, "seed": 3, "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.text.splitlines() if line]
    assert all(line.isascii() and line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    reply = await client.post("/v1/completions", json={**body, "stream": False})
    assert text == reply.json()["choices"][0]["text"]


@pytest.mark.parametrize("raised", ["failure", "bug"])
async def test_a_failure_after_the_stream_started_is_an_error_event(
    app, client, raised, monkeypatch
):
    """Once the status line is sent, a failure is the stream's last event before [DONE]: its
    own error shape for a domain failure, an internal error (no details) for anything else."""
    from app.common.failures import Conflict

    service = app.state.openai

    async def fail(job, sampled):  # type: ignore[no-untyped-def]
        if raised == "failure":
            raise Conflict("the trajectory changed", param="trajectory_id")
        raise RuntimeError("a secret detail")

    monkeypatch.setattr(service, "_record", fail)
    body = {"model": "policy", "prompt": "x", "max_tokens": 4, "seed": 3, "stream": True}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all("error" not in json.loads(line[6:]) for line in lines[:-2])
    error = json.loads(lines[-2][6:])["error"]
    if raised == "failure":
        assert error == {
            "message": "the trajectory changed",
            "type": "conflict_error",
            "param": "trajectory_id",
            "code": 409,
        }
    else:
        assert error == {
            "message": "internal error",
            "type": "internal_error",
            "param": None,
            "code": 500,
        }


@pytest.mark.parametrize("k", [0, 2])
async def test_echo_shows_the_prompt_and_its_log_probs(sdk, client, reference_log_probs, k):
    """vLLM's echo, as AReaL's teacher scoring sends it (token prompt, max_tokens 1, greedy,
    logprobs and prompt_logprobs): the text and log-probs begin with the prompt's, the first
    prompt token's log-prob is null, the rest are the model's own (a plain forward)."""
    prompt = [5, 6, 7, 8, 9]
    reply = await sdk.completions.create(
        model="policy",
        prompt=prompt,
        max_tokens=1,
        temperature=0.0,
        logprobs=k,
        echo=True,
        extra_body={"prompt_logprobs": 1, "return_token_ids": True},
    )
    (choice,) = reply.choices
    extra = choice.model_extra or {}
    sampled = extra["token_ids"]
    decoded = (await client.post("/detokenize", json={"tokens": prompt})).json()["prompt"]
    assert choice.text.startswith(decoded) and len(choice.text) >= len(decoded)
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + len(sampled)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = reference_log_probs(prompt + sampled)
    assert_close(logprobs.token_logprobs[1:], expected[1:], 1e-4)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[len(prompt)] == len(decoded)
    for row in logprobs.top_logprobs[1 : len(prompt)]:
        assert len(row) == max(k, 1)
    # AReaL reads the prompt's own log-prob from prompt_logprobs (first entry of each row)
    scored = [next(iter(r.values()))["logprob"] for r in extra["prompt_logprobs"][1:]]
    assert_close(scored, expected[1 : len(prompt)], 1e-4)
    assert all(len(r) <= 2 for r in extra["prompt_logprobs"][1:])  # its own and the top 1


async def test_fields_the_server_ignores_are_named_to_the_client(client):
    """vLLM's leniency (an unknown field is ignored, not refused), with a sign to the client:
    a misspelled `temprature` is named in a response header, streamed or not."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    plain = await client.post("/v1/chat/completions", json=chat)
    assert plain.status_code == 200 and "x-ignored-fields" not in plain.headers
    typo = await client.post("/v1/chat/completions", json={**chat, "temprature": 0.5, "a": 1})
    assert typo.status_code == 200 and typo.headers["x-ignored-fields"] == "a, temprature"
    streamed = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True, "tmp": 1}
    )
    assert streamed.status_code == 200 and streamed.headers["x-ignored-fields"] == "tmp"
    # A header holds ASCII: other names are percent-encoded, and at most 32 are named.
    many = {f"f{i:02d}": 1 for i in range(40)}
    body = {"prompt": "hi", "max_tokens": 2, "_é😀": 1, **many}
    odd = await client.post("/v1/completions", json=body)
    assert odd.status_code == 200, odd.text
    named = odd.headers["x-ignored-fields"].split(", ")
    assert named[:2] == ["_%C3%A9%F0%9F%98%80", "f00"] and len(named) == 33
    assert named[-1] == "... (9 more)"
