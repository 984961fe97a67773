"""`/tokenize` and `/detokenize` as vLLM and SGLang answer them: a chat's tokens are the very
prompt /v1/generate builds, a prompt's are the tokenizer's own, and the text comes back; the
developer role reaches the prompt."""

from __future__ import annotations

import httpx

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3?"},
]


async def ok(response: httpx.Response) -> dict:  # type: ignore[type-arg]
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_a_chats_tokens_are_the_prompt_v1_generate_builds(client):
    generated = await ok(
        await client.post("/v1/generate", json={"messages": [CHAT], "max_new_tokens": 1})
    )
    prompt = generated["outputs"][0][0]["tokens"]["prompt"]
    for path in ("/tokenize", "/v1/tokenize"):
        answer = await ok(await client.post(path, json={"messages": CHAT, "model": "policy"}))
        assert answer["tokens"] == prompt and answer["count"] == len(prompt)
        assert answer["max_model_len"] > 0
    # continue_final_message leaves the assistant's turn open: its text ends the prompt.
    body = {
        "messages": [*CHAT, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    answer = await ok(await client.post("/tokenize", json=body))
    text = (await ok(await client.post("/detokenize", json={"tokens": answer["tokens"]})))["prompt"]
    assert text.endswith("It is")
    both = {**body, "add_generation_prompt": True}
    refused = await client.post("/tokenize", json=both)
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "continue_final_message"


async def test_prompts_and_detokenize_round_trip(client, hf_tokenizer):
    text = "Hello, world"
    answer = await ok(
        await client.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    )
    assert answer["tokens"] == hf_tokenizer.encode(text)
    assert answer["token_strs"] == hf_tokenizer.convert_ids_to_tokens(answer["tokens"])
    plain = await ok(
        await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    )
    assert plain["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)
    back = await ok(await client.post("/detokenize", json={"tokens": plain["tokens"]}))
    assert back["prompt"] == back["text"] == hf_tokenizer.decode(plain["tokens"])
    # SGLang's forms: several prompts at once, several sequences at once.
    many = await ok(await client.post("/v1/tokenize", json={"prompt": [text, "abc"]}))
    assert many["tokens"][1] == hf_tokenizer.encode("abc") and many["count"][1] == len(
        many["tokens"][1]
    )
    eos = hf_tokenizer.eos_token_id
    rows = [plain["tokens"] + [eos], [97, 98]]
    texts = await ok(await client.post("/v1/detokenize", json={"tokens": rows}))
    assert texts["text"] == [hf_tokenizer.decode(r, skip_special_tokens=True) for r in rows]
    kept = await ok(await client.post("/detokenize", json={"tokens": rows[0]}))
    assert kept["prompt"] == hf_tokenizer.decode(rows[0])  # vLLM keeps special tokens
    outside = await client.post("/detokenize", json={"tokens": [1, 10**6]})
    assert outside.status_code == 422 and outside.json()["error"]["param"] == "tokens"
    nothing = await client.post("/tokenize", json={"model": "policy"})
    assert nothing.status_code == 422 and nothing.json()["error"]["param"] == "prompt"


async def test_the_developer_role_reaches_the_prompt(client):
    """OpenAI's developer messages are instructions: never dropped from the prompt (as system
    where the template knows no developer role)."""
    chat = [
        {"role": "developer", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]
    answer = await ok(await client.post("/tokenize", json={"messages": chat}))
    text = (await ok(await client.post("/detokenize", json={"tokens": answer["tokens"]})))["prompt"]
    assert "Answer in French." in text
    reply = await ok(
        await client.post(
            "/v1/chat/completions",
            json={"messages": chat, "max_tokens": 1, "return_token_ids": True},
        )
    )
    assert reply["prompt_token_ids"] == answer["tokens"]
