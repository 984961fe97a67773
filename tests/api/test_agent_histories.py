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
