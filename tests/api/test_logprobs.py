"""/v1/logprobs against an independent forward of the same model."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import assert_close

TOL = 1e-5
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


async def score(client: httpx.AsyncClient, **body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post("/v1/logprobs", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_tokens_unequal_lengths_match_independent_forward(client, reference_log_probs):
    sequences = [[5, 77, 12, 200, 3, 9, 41], [100, 2], list(range(30, 90)), [7]]
    body = await score(client, tokens=sequences)
    assert body["policy_version"] == 0
    for seq, out in zip(sequences, body["outputs"], strict=True):
        assert out["tokens"]["full"] == seq
        assert out["log_probs"]["full"][0] == 0.0
        assert_close(out["log_probs"]["full"], reference_log_probs(seq), TOL)
        assert out["masks"]["all_attention_mask"] == [1] * len(seq)


async def test_batch_values_equal_single_values(client):
    sequences = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    together = (await score(client, tokens=sequences))["outputs"]
    for seq, batched in zip(sequences, together, strict=True):
        alone = (await score(client, tokens=[seq]))["outputs"][0]
        assert_close(batched["log_probs"]["full"], alone["log_probs"]["full"], TOL)


async def test_text_mode(client, hf_tokenizer, reference_log_probs):
    texts = ["The quick brown fox", "héllo wörld ✓"]
    body = await score(client, text=texts)
    for text, out in zip(texts, body["outputs"], strict=True):
        ids = hf_tokenizer(text)["input_ids"]
        assert out["tokens"]["full"] == ids
        assert out["text"]["full"] == text
        assert_close(out["log_probs"]["full"], reference_log_probs(ids), TOL)


async def test_history_mode_templates_without_generation_prompt(
    client, hf_tokenizer, reference_log_probs
):
    body = await score(client, messages=[CONVERSATION])
    out = body["outputs"][0]
    templated = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    ids = hf_tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert out["text"]["full"] == templated
    assert out["tokens"]["full"] == ids
    assert_close(out["log_probs"]["full"], reference_log_probs(ids), TOL)
    # The last assistant turn is the response; the prompt is templated with the generation prompt.
    prompt = hf_tokenizer.apply_chat_template(CONVERSATION[:-1], add_generation_prompt=True)
    prompt_ids = list(prompt["input_ids"])
    assert out["tokens"]["prompt"] == prompt_ids
    assert out["tokens"]["prompt"] + out["tokens"]["response"] == ids
    assert out["log_probs"]["prompt"] + out["log_probs"]["response"] == out["log_probs"]["full"]
    assert out["history"]["prompt"] == CONVERSATION[:-1]
    assert out["history"]["response"] == CONVERSATION[-1:]


async def test_assistant_mask_marks_exactly_assistant_content(client, hf_tokenizer):
    conversation = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello there"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ok"},
    ]
    out = (await score(client, messages=[conversation]))["outputs"][0]
    ids, mask = out["tokens"]["full"], out["masks"]["all_assistant_mask"]
    assert len(mask) == len(ids)
    end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # Independently: each assistant turn is its content's bytes followed by <|im_end|>.
    expected_runs = [
        [*list(b"hello there"), end],
        [*list(b"ok"), end],
    ]
    runs, current = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    assert runs == expected_runs


async def test_text_split(client, hf_tokenizer, reference_log_probs):
    body = await score(client, prompt_text=["Question: 3+4? "], response_text=["Answer: 7"])
    out = body["outputs"][0]
    prompt_ids = hf_tokenizer("Question: 3+4? ")["input_ids"]
    response_ids = hf_tokenizer("Answer: 7", add_special_tokens=False)["input_ids"]
    assert out["tokens"]["prompt"] == prompt_ids
    assert out["tokens"]["response"] == response_ids
    assert out["text"]["response"] == "Answer: 7"
    expected = reference_log_probs(prompt_ids + response_ids)
    assert_close(out["log_probs"]["full"], expected, TOL)
    assert out["log_probs"]["response"] == out["log_probs"]["full"][len(prompt_ids) :]
    assert out["masks"]["all_assistant_mask"] == [0] * len(prompt_ids) + [1] * len(response_ids)


async def test_token_split(client, reference_log_probs):
    body = await score(client, prompt_tokens=[[4, 5, 6]], response_tokens=[[7, 8]])
    out = body["outputs"][0]
    assert out["tokens"] == {"prompt": [4, 5, 6], "response": [7, 8], "full": [4, 5, 6, 7, 8]}
    assert_close(out["log_probs"]["full"], reference_log_probs([4, 5, 6, 7, 8]), TOL)
    assert "text" not in out


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_text": ["a"]}, "response_text"),
        ({"response_tokens": [[1]]}, "response_tokens"),
        ({"prompt_tokens": [[1], [2]], "response_tokens": [[3]]}, "response_tokens"),
        ({"tokens": [[]]}, "tokens[0]"),
        ({"text": [""]}, "text[0]"),
        ({"messages": [[]]}, "messages[0]"),
        ({"messages": [[{"role": "user"}]]}, "messages[0][0].content"),
        ({"tokens": [[1, -4]]}, "tokens[0][1]"),
        ({"tokens": [[1, 2], [3, 259]]}, "tokens[1]"),
        ({"tokens": [[1]], "model": "critic"}, "model"),
    ],
)
async def test_invalid_scoring_requests(client, body, param):
    """Each refusal names its field; a model nothing is served as is a 404 (as on every route
    that takes a model name, vLLM's and OpenAI's answer), the rest 422."""
    response = await client.post("/v1/logprobs", json=body)
    code = 404 if param == "model" else 422
    assert response.status_code == code, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(param)
    assert error["code"] == code


async def test_oversized_requests(client, settings):
    longest = (await client.get("/v1/models")).json()["models"][0]["max_model_len"]
    response = await client.post("/v1/logprobs", json={"tokens": [[1] * (longest + 1)]})
    assert response.status_code == 422
    assert f"maximum length of {longest}" in response.json()["error"]["message"]
    many = [[1, 2]] * (settings.limits.max_items_per_request + 1)
    response = await client.post("/v1/logprobs", json={"tokens": many})
    assert response.status_code == 413
    assert response.json()["error"]["param"] == "tokens"
    # ...and the server keeps serving.
    assert (await client.post("/v1/logprobs", json={"tokens": [[1, 2]]})).status_code == 200


async def test_malformed_json_is_a_422(client):
    response = await client.post(
        "/v1/logprobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["type"] == "invalid_request_error"
