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
