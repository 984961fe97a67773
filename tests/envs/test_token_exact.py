"""Token actions enter the episode exactly as sent: reset -> step -> next observation -> /v1/kl,
with the KL penalty over exactly the action's tokens (against a reference that differs)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import forward_log_probs
from tests.envs.test_envs_api import call, create

# Invalid UTF-8 bytes (240 159 opens a 4-byte sequence that 72 breaks, 200 is a lone lead
# byte), then <|im_end|>: decoding and re-encoding would give other ids.
ACTION = [240, 159, 72, 200, 256]
IM_END = 256


def chatml_ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


async def test_token_action_round_trips_into_the_next_prompt(client, hf_tokenizer):
    env = await create(client, max_turns=3)
    (obs,) = (await call(client, f"/v1/envs/{env}/reset", {"query": ["hi"]}))["observations"]
    prompt = obs["prompt_tokens"]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": ACTION}]})
    following = step["outputs"][0]["observation"]["prompt_tokens"]
    # ChatML closes the turn with <|im_end|>\n (the action wrote <|im_end|> itself) and opens
    # the next assistant turn.
    tail = chatml_ids(hf_tokenizer, "\n<|im_start|>assistant\n")
    assert following == prompt + ACTION + tail
    # Re-encoding the decoded text would not give the action back: the drift this avoids.
    decoded = hf_tokenizer.decode(ACTION, skip_special_tokens=True)
    assert chatml_ids(hf_tokenizer, decoded) != ACTION[:-1]
    # A second token action without an end-of-turn token gets the template's one.
    second = [104, 105]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": second}]})
    again = step["outputs"][0]["observation"]["prompt_tokens"]
    closing = chatml_ids(hf_tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    assert again == following + second + closing


async def test_text_actions_are_encoded_once_and_match_the_template(client, hf_tokenizer):
    env = await create(client, system_prompt="Be brief.")
    await call(client, f"/v1/envs/{env}/reset", {"query": ["What is 2+3?"]})
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": "It is 5."}]})
    obs = step["outputs"][0]["observation"]
    rendered = hf_tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+3?"},
            {"role": "assistant", "content": "It is 5."},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert obs["prompt_tokens"] == chatml_ids(hf_tokenizer, rendered)
    assert obs["prompt_text"] == rendered


@pytest.mark.parametrize("kind", ["chat", "tokens"])
async def test_kl_penalty_counts_exactly_the_action_tokens(
    two_model_client: httpx.AsyncClient, hf_model, ref_model, kind
):
    client = two_model_client
    env = await create(client, kind=kind, kl={"coeff": 0.5, "estimator": "k1"})
    body = {"query": ["Say something."]} if kind == "chat" else {"tokens": [[72, 101, 121]]}
    (obs,) = (await call(client, f"/v1/envs/{env}/reset", body))["observations"]
    prompt = obs["prompt_tokens"]
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": ACTION}]})
    breakdown = step["outputs"][0]["info"]["reward"]
    # Independent: plain forwards of both models over prompt + action, summed over the action.
    full = prompt + ACTION
    p, q = forward_log_probs(hf_model, full), forward_log_probs(ref_model, full)
    expected = sum(a - b for a, b in zip(p[len(prompt) :], q[len(prompt) :], strict=True))
    assert abs(expected) > 1e-3  # the two models differ: the check can fail
    assert breakdown["kl"] == pytest.approx(expected, abs=1e-4)
    assert step["outputs"][0]["reward"] == pytest.approx(-0.5 * expected, abs=1e-4)
    # ... and /v1/kl on the same tokens gives the same number.
    kl = await call(
        client,
        "/v1/kl",
        {"prompt_tokens": [prompt], "response_tokens": [ACTION], "estimator": "k1"},
    )
    assert kl["outputs"][0]["kl_sum"] == pytest.approx(breakdown["kl"], abs=1e-5)
    assert kl["outputs"][0]["num_counted"] == len(ACTION)
    if kind == "tokens":
        assert step["outputs"][0]["observation"]["prompt_tokens"] == full


async def test_one_tool_message_per_block_in_torchrl_wording(client, hf_tokenizer):
    env = await create(client, tools=["python"])
    (obs,) = (await call(client, f"/v1/envs/{env}/reset", {"query": ["compute"]}))["observations"]
    action = (
        "Run:\n```python\nimport sys\nprint('out')\nprint('err', file=sys.stderr)\n```\n"
        "and\n```python\nprint('before')\nraise ValueError('no')\n```"
    )
    step = await call(client, f"/v1/envs/{env}/step", {"actions": [{"text": action}]})
    history = step["outputs"][0]["observation"]["history"]
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool"]
    assert history[2]["content"] == "Code block 1 executed successfully:\nout\n"
    failed = history[3]["content"]
    assert failed.startswith("Code block 2 failed:\nTraceback")
    assert failed.endswith("ValueError: no\n") and "before" not in failed
    # The next prompt: the exact action ids, then the template's rendering of what follows.
    rendered = hf_tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    prompt = hf_tokenizer.apply_chat_template(
        history[:1], tokenize=False, add_generation_prompt=True
    )
    action_ids = chatml_ids(hf_tokenizer, action)
    assert step["outputs"][0]["observation"]["prompt_tokens"] == (
        obs["prompt_tokens"]
        + action_ids
        + chatml_ids(hf_tokenizer, rendered[len(prompt + action) :])
    )


async def test_token_actions_outside_the_vocabulary_are_422(client):
    env = await create(client)
    await call(client, f"/v1/envs/{env}/reset", {"query": ["hi"]})
    bad = await client.post(f"/v1/envs/{env}/step", json={"actions": [{"tokens": [65, 10**6]}]})
    assert bad.status_code == 422
    assert bad.json()["error"]["param"] == "actions[0].tokens"
    ok = await call(client, f"/v1/envs/{env}/step", {"actions": [{"tokens": [65]}]})
    assert ok["outputs"][0]["observation"]["history"][-1]["content"] == "A"
