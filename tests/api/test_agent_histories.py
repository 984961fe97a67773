"""An agent's history in the chat route's shape (assistant tool calls, tool results, vLLM's
`reasoning`) is taken by `/v1/generate` and `/v1/logprobs` and templated exactly as the chat
route templates it, so an episode sampled on one route is scored on another token for token."""

from __future__ import annotations

from typing import Any

import httpx

HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning": "The user wants the weather.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21C and sunny"},
]


async def test_a_tool_using_history_is_templated_as_on_the_chat_route(
    client: httpx.AsyncClient, hf_tokenizer: Any
) -> None:
    body = {"model": "policy", "messages": HISTORY, "max_tokens": 1, "return_token_ids": True}
    chat = await client.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200, chat.text
    prompt = chat.json()["prompt_token_ids"]

    generated = await client.post("/v1/generate", json={"messages": [HISTORY], "max_tokens": 1})
    assert generated.status_code == 200, generated.text
    assert generated.json()["outputs"][0][0]["tokens"]["prompt"] == prompt

    scored = await client.post("/v1/logprobs", json={"messages": [HISTORY]})
    assert scored.status_code == 200, scored.text
    output = scored.json()["outputs"][0]
    full = output["tokens"]["full"]
    assert prompt[: len(full)] == full  # (the chat prompt adds the assistant's opening)
    mask = output["masks"]["all_assistant_mask"]
    marked = [token for token, m in zip(full, mask, strict=True) if m]
    assert '"name": "get_weather"' in hf_tokenizer.decode(marked)  # the call is the assistant's

    # vLLM's `reasoning` and `reasoning_content` are one field, as on the chat route
    renamed = [dict(m) for m in HISTORY]
    renamed[1]["reasoning_content"] = renamed[1].pop("reasoning")
    again = await client.post("/v1/logprobs", json={"messages": [renamed]})
    assert again.json()["outputs"][0]["tokens"]["full"] == full


async def test_a_malformed_tool_call_in_history_names_its_field(client: httpx.AsyncClient) -> None:
    broken = [dict(m) for m in HISTORY]
    broken[1] = {**broken[1], "tool_calls": [{"id": "call_1", "function": {"name": "x"}}]}
    refused = await client.post("/v1/logprobs", json={"messages": [broken]})
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"].startswith("messages[0][1].tool_calls[0]")


async def test_a_reply_sent_back_as_the_openai_sdk_dumps_it_is_taken(
    client: httpx.AsyncClient,
) -> None:
    """Agents append the SDK's reply message to their history as it came (`model_dump()`:
    refusal, annotations, audio and function_call, null); a refusal with no content is the
    turn's content; a non-null audio or function_call is refused naming the field."""
    from openai.types.chat import ChatCompletionMessage

    body = {"model": "policy", "messages": HISTORY[:1], "max_tokens": 3, "temperature": 0}
    reply = await client.post("/v1/chat/completions", json=body)
    message = ChatCompletionMessage.model_validate(reply.json()["choices"][0]["message"])
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    history = [*HISTORY[:1], dumped, {"role": "user", "content": "And tomorrow?"}]
    for route, sent in (
        ("/v1/chat/completions", {**body, "messages": history}),
        ("/v1/generate", {"messages": [history], "max_tokens": 1}),
        ("/v1/logprobs", {"messages": [history]}),
    ):
        taken = await client.post(route, json=sent)
        assert taken.status_code == 200, (route, taken.text)

    refused_turn = {"role": "assistant", "content": None, "refusal": "I cannot help with that."}
    as_content = {"role": "assistant", "content": "I cannot help with that."}
    scored = [
        (await client.post("/v1/logprobs", json={"messages": [[*HISTORY[:1], m]]})).json()
        for m in (refused_turn | {"content": ""}, as_content)
    ]
    assert scored[0]["outputs"][0]["tokens"] == scored[1]["outputs"][0]["tokens"]
    chat = await client.post(
        "/v1/chat/completions", json={**body, "messages": [*HISTORY[:1], refused_turn]}
    )
    assert chat.status_code == 200, chat.text
    for field in ("audio", "function_call"):
        bad = {**dumped, field: {"id": "x"}}
        refused = await client.post(
            "/v1/chat/completions", json={**body, "messages": [*HISTORY[:1], bad]}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == f"messages[1].{field}"
