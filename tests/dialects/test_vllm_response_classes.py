"""rlserve's answers on vLLM's routes, read by vLLM's own response classes (vLLM 0.32's
protocol models, in the vLLM venv): every field vLLM declares parses, and reads back as sent."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm
generate_protocol = pytest.importorskip(
    "vllm.entrypoints.scale_out.token_in_token_out.protocol", reason="vLLM is not installed"
)
tokenize_protocol = pytest.importorskip("vllm.entrypoints.serve.tokenize.protocol")

PROMPT = [72, 101, 108, 108, 111, 44, 32]


def known(sent: dict, parsed: dict) -> None:  # type: ignore[type-arg]
    """Each field vLLM's class kept reads back as sent (ours may carry more)."""
    for key, value in parsed.items():
        if isinstance(value, dict) and isinstance(sent.get(key), dict):
            known(sent[key], value)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for mine, theirs in zip(sent[key], value, strict=True):
                known(mine, theirs)
        else:
            assert sent.get(key) == value, (key, sent.get(key), value)


async def test_inference_generate_answers_parse_as_vllms(client):
    for mode in ("tokens", "text"):
        body = {
            "token_ids": PROMPT,
            "output_mode": mode,
            "return_token_ids": True,
            "sampling_params": {"max_tokens": 4, "logprobs": 2, "prompt_logprobs": 1, "n": 2},
        }
        answer = await client.post("/inference/v1/generate", json=body)
        assert answer.status_code == 200, answer.text
        sent = answer.json()
        cls = (
            generate_protocol.GenerateTextResponse
            if mode == "text"
            else (generate_protocol.GenerateTokensResponse)
        )
        parsed = cls.model_validate(sent)
        assert len(parsed.choices) == 2 and parsed.prompt_token_ids == PROMPT
        known(sent, parsed.model_dump(mode="json", exclude_unset=True))


async def test_tokenize_answers_parse_as_vllms(client):
    answer = await client.post("/tokenize", json={"prompt": "Hello", "return_token_strs": True})
    parsed = tokenize_protocol.TokenizeResponse.model_validate(answer.json())
    assert parsed.count == len(parsed.tokens) and parsed.token_strs
    back = await client.post("/detokenize", json={"tokens": parsed.tokens})
    assert tokenize_protocol.DetokenizeResponse.model_validate(back.json()).prompt


async def test_render_and_derender_answers_parse_as_vllms(client):
    """The rendered body is vLLM's GenerateRequest; the derender body rlserve reads is one
    vLLM's DerenderChatRequest reads; the reply is vLLM's ChatCompletionResponse."""
    chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
    completion_protocol = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    chat = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 2,
    }
    rendered = (await client.post("/v1/chat/completions/render", json=chat)).json()
    request = generate_protocol.GenerateRequest.model_validate(rendered)
    assert request.token_ids == rendered["token_ids"]
    assert request.sampling_params.seed == 3 and request.sampling_params.max_tokens == 4
    generated = (await client.post("/inference/v1/generate", json=rendered)).json()
    body = {"generate_response": generated, "chat_request": chat}
    assert generate_protocol.DerenderChatRequest.model_validate(body).chat_request is not None
    answer = await client.post("/v1/chat/completions/derender", json=body)
    assert answer.status_code == 200, answer.text
    sent = answer.json()
    parsed = chat_protocol.ChatCompletionResponse.model_validate(sent)
    assert len(parsed.choices[0].logprobs.content) == len(generated["choices"][0]["token_ids"])
    known(sent, parsed.model_dump(mode="json", exclude_unset=True))
    completion = {"model": "policy", "prompt": ["a b", "c d"], "max_tokens": 3, "seed": 2}
    rendered = (await client.post("/v1/completions/render", json=completion)).json()
    answers = []
    for one in rendered:
        generate_protocol.GenerateRequest.model_validate(one)
        answers.append((await client.post("/inference/v1/generate", json=one)).json())
    body = {"generate_responses": answers, "completion_request": completion}
    generate_protocol.DerenderCompletionRequest.model_validate(body)
    answer = await client.post("/v1/completions/derender", json=body)
    assert answer.status_code == 200, answer.text
    parsed_completion = completion_protocol.CompletionResponse.model_validate(answer.json())
    assert len(parsed_completion.choices) == 2
