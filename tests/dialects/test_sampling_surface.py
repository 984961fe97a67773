"""The sampling parameters trainers send on vLLM's and SGLang's routes (min-tokens, stop ids,
penalties, logit bias, allowed tokens, bad words), each against a greedy decoder written here
over a plain forward of the same model that applies the rule as vLLM's sampler does; what is
accepted and ignored, what is refused by name; vLLM's text mode and prompt log-probs."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import torch

from tests.conftest import assert_close, forward_log_probs

PROMPT = [72, 101, 108, 108, 111, 44, 32]
Process = Callable[[torch.Tensor, list[int]], torch.Tensor]


def greedy(
    model: torch.nn.Module,
    prompt: list[int],
    steps: int,
    process: Process,
    stop: Callable[[int, list[int]], bool] = lambda token, out: False,
) -> list[int]:
    """Greedy decoding by full forwards: `process` shapes each step's logits (given the
    tokens generated so far); `stop` ends after a token."""
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        token = int(process(logits.clone(), out).argmax())
        out.append(token)
        if stop(token, out):
            break
    return out


async def vllm_tokens(client: httpx.AsyncClient, **params: object) -> dict:  # type: ignore[type-arg]
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "logprobs": 0, **params}}
    answer = await client.post("/inference/v1/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]  # type: ignore[no-any-return]


async def test_penalties_and_logit_bias_apply_in_vllms_order(client, hf_model):
    plain = await vllm_tokens(client, max_tokens=10, ignore_eos=True)
    favoured = plain["token_ids"][1]
    params = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {favoured: 2.5}}

    def process(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        logits[favoured] += 2.5
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0])
        return logits - 1.5 * counts - 0.5 * (counts > 0).float()

    got = await vllm_tokens(client, max_tokens=10, ignore_eos=True, **params)
    want = greedy(hf_model, PROMPT, 10, process)
    assert got["token_ids"] == want
    assert want != plain["token_ids"]  # the parameters changed something
    # The log-probs returned are the raw model's, whatever shaped the choice.
    raw = forward_log_probs(hf_model, PROMPT + want)[len(PROMPT) :]
    assert_close([e["logprob"] for e in got["logprobs"]["content"]], raw, 1e-4)


async def test_allowed_token_ids_and_bad_words(client, hf_model, hf_tokenizer):
    plain = await vllm_tokens(client, max_tokens=6, ignore_eos=True)
    allowed = sorted({*plain["token_ids"][2:5], 50, 51})

    def only_allowed(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    got = await vllm_tokens(client, max_tokens=6, ignore_eos=True, allowed_token_ids=allowed)
    assert got["token_ids"] == greedy(hf_model, PROMPT, 6, only_allowed)
    # A bad word, favoured by a logit bias so that it would be sampled, banned as vLLM
    # tokenizes it (as written, and with a leading space where that is as many tokens).
    word = "a"
    sequences = [hf_tokenizer.encode(word, add_special_tokens=False)]
    spaced = hf_tokenizer.encode(" " + word, add_special_tokens=False)
    if spaced[0] != sequences[0][0] and len(spaced) == len(sequences[0]):
        sequences.append(spaced)
    bias = {sequences[0][-1]: 8.0}

    def biased_without_bad_word(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        for sequence in sequences:
            *prefix, last = sequence
            if len(prefix) <= len(out) and (not prefix or out[-len(prefix) :] == prefix):
                logits[last] = float("-inf")
        logits[sequences[0][-1]] += 8.0
        return logits

    favoured = await vllm_tokens(client, max_tokens=6, ignore_eos=True, logit_bias=bias)
    assert sequences[0][-1] in favoured["token_ids"]
    got = await vllm_tokens(
        client, max_tokens=6, ignore_eos=True, logit_bias=bias, bad_words=[word]
    )
    assert got["token_ids"] == greedy(hf_model, PROMPT, 6, biased_without_bad_word)
    assert sequences[0][-1] not in got["token_ids"]


async def test_stop_token_ids_and_min_tokens(client, hf_model, hf_tokenizer):
    plain = await vllm_tokens(client, max_tokens=8, ignore_eos=True)
    tokens = plain["token_ids"]
    # Stopping at an id: the output ends with it, and stop_reason names it.
    stopped = await vllm_tokens(client, max_tokens=8, stop_token_ids=[tokens[2]])
    first = tokens.index(tokens[2])
    assert stopped["token_ids"] == tokens[: first + 1]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == tokens[2]
    # ... and so do the OpenAI routes' choices (vLLM's stop_reason), a stop string's too;
    # end-of-sequence and the length limit name none.
    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    completion = await client.post(
        "/v1/completions", json={**body, "stop_token_ids": [tokens[2]], "return_token_ids": True}
    )
    (choice,) = completion.json()["choices"]
    assert choice["token_ids"] == tokens[: first + 1] and choice["stop_reason"] == tokens[2]
    text = hf_tokenizer.decode(tokens[:3])
    by_text = await client.post("/v1/completions", json={**body, "stop": [text[-2:]]})
    (choice,) = by_text.json()["choices"]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == text[-2:]
    # (sent as null, as vLLM sends it: a trainer reads choice["stop_reason"])
    long = await client.post("/v1/completions", json={**body, "ignore_eos": True})
    (choice,) = long.json()["choices"]
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    (choice,) = (await client.post("/v1/chat/completions", json=chat)).json()["choices"]
    assert choice["stop_reason"] is None and choice["logprobs"] is None
    assert {"content", "refusal", "reasoning"} <= choice["message"].keys()
    # min_tokens holds back the stop ids and end-of-sequence until that many tokens are out.
    held = {tokens[0], hf_tokenizer.eos_token_id}

    def hold(logits: torch.Tensor, out: list[int]) -> torch.Tensor:
        if len(out) < 4:
            logits[sorted(held)] = float("-inf")
        return logits

    got = await vllm_tokens(client, max_tokens=8, min_tokens=4, stop_token_ids=[tokens[0]])
    want = greedy(hf_model, PROMPT, 8, hold, stop=lambda token, out: token in held)
    assert got["token_ids"] == want and want[0] != tokens[0]


async def test_sglang_takes_the_same_parameters_under_its_names(client, hf_tokenizer):
    """SGLang's names (min_new_tokens, logit_bias keyed by strings, AReaL's [pad, eos] stop
    ids) sample what vLLM's names do."""
    plain = await vllm_tokens(client, max_tokens=8, ignore_eos=True)
    stop_ids = [plain["token_ids"][3], hf_tokenizer.eos_token_id]
    vllm = await vllm_tokens(
        client,
        max_tokens=8,
        min_tokens=2,
        stop_token_ids=stop_ids,
        frequency_penalty=0.7,
        logit_bias={plain["token_ids"][5]: 1.5},
    )
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 8,
            "min_new_tokens": 2,
            "stop_token_ids": stop_ids,
            "frequency_penalty": 0.7,
            "logit_bias": {str(plain["token_ids"][5]): 1.5},
            "top_k": None,
        },
    }
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    sglang = answer.json()
    assert sglang["output_ids"] == vllm["token_ids"]
    if vllm["stop_reason"] is not None:
        assert sglang["meta_info"]["finish_reason"] == {
            "type": "stop",
            "matched": vllm["stop_reason"],
        }


async def test_vllm_text_mode_and_prompt_logprobs(client, hf_model, hf_tokenizer):
    body = {
        "token_ids": PROMPT,
        "output_mode": "text",
        "sampling_params": {
            "temperature": 0,
            "max_tokens": 6,
            "ignore_eos": True,
            "logprobs": 2,
            "prompt_logprobs": 1,
            "skip_special_tokens": True,
        },
    }
    answer = await client.post("/inference/v1/generate", json=body)
    assert answer.status_code == 200, answer.text
    reply = answer.json()
    choice = reply["choices"][0]
    ids = choice["token_ids"]
    assert reply["output_mode"] == "text"
    assert choice["text"] == hf_tokenizer.decode(ids, skip_special_tokens=True)
    raw = forward_log_probs(hf_model, PROMPT + ids)
    for entry, token, value in zip(
        choice["logprobs"]["content"], ids, raw[len(PROMPT) :], strict=True
    ):
        name = hf_tokenizer.decode([token])
        assert entry["token"] == name and entry["bytes"] == list(name.encode())
        assert abs(entry["logprob"] - value) < 1e-4
        # vLLM's list: the sampled token first, then the most likely, 2 in all
        assert entry["top_logprobs"][0]["token"] == name and len(entry["top_logprobs"]) == 2
    rows = reply["prompt_logprobs"]
    assert rows[0] is None and len(rows) == len(PROMPT)
    for p in range(1, len(PROMPT)):
        assert abs(rows[p][str(PROMPT[p])]["logprob"] - raw[p]) < 1e-4


async def test_what_vllm_ignores_is_accepted_and_what_would_change_answers_is_refused(client):
    ignored = {
        "token_ids": PROMPT,
        "sampling_params": {
            "max_tokens": 2,
            "use_beam_search": False,
            "best_of": 1,
            "output_kind": 0,
            "skip_reading_prefix_cache": True,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
            "truncate_prompt_tokens": 3,
        },
        "some_future_field": {"x": 1},
        "return_token_ids": True,
    }
    answer = await client.post("/inference/v1/generate", json=ignored)
    assert answer.status_code == 200, answer.text
    assert answer.json()["prompt_token_ids"] == PROMPT[-3:]  # truncate_prompt_tokens
    refused = [
        ({"use_beam_search": True}, "sampling_params.use_beam_search"),
        ({"best_of": 3}, "sampling_params.best_of"),
        ({"logit_bias": {"99999999": 1.0}}, "sampling_params.logit_bias"),
        ({"allowed_token_ids": []}, "sampling_params.allowed_token_ids"),
        ({"min_tokens": 9, "max_tokens": 4}, "sampling_params.min_tokens"),
        ({"structured_outputs": {"regex": "a+"}}, "sampling_params.structured_outputs"),
        ({"output_kind": 1}, "sampling_params.output_kind"),
    ]
    for params, field in refused:
        body = {"token_ids": PROMPT, "sampling_params": params}
        answer = await client.post("/inference/v1/generate", json=body)
        assert answer.status_code == 422, (params, answer.text)
        assert answer.json()["error"]["param"] == field, (params, answer.text)
    body = {"input_ids": PROMPT, "sampling_params": {"regex": "a+"}}
    answer = await client.post("/generate", json=body)
    assert answer.status_code == 422 and answer.json()["error"]["param"] == (
        "sampling_params.regex"
    )


@pytest.fixture
async def aliased(settings):  # type: ignore[no-untyped-def]
    from tests.conftest import served_app

    aliases = {"served_model_name": ["default", "org/policy-1"]}
    data_dir = settings.storage.data_dir / "aliased"
    async with served_app(settings.replace(models=aliases, storage={"data_dir": data_dir})) as c:
        yield c


async def test_served_model_names_reach_the_policy(aliased):
    ids = [card["id"] for card in (await aliased.get("/v1/models")).json()["data"]]
    assert ids[:2] == ["policy", "reference"] and {"default", "org/policy-1"} <= set(ids)
    body = {"token_ids": PROMPT, "model": "org/policy-1", "sampling_params": {"max_tokens": 2}}
    answer = await aliased.post("/inference/v1/generate", json=body)
    assert answer.status_code == 200 and answer.json()["model"] == "org/policy-1"
    # a name nothing is served as (a trainer's default, SkyRL's model path): 404 as vLLM
    # answers, naming the flag that serves it, as every route names it
    body["model"] = "someone-else"
    for path, named in (
        ("/inference/v1/generate", body),
        ("/v1/completions", {**body, "prompt": "x"}),
        ("/v1/generate", {"text": ["x"], "model": "someone-else"}),
        ("/tokenize", {"model": "someone-else", "prompt": "x"}),
    ):
        answer = await aliased.post(path, json=named)
        assert answer.status_code == 404, (path, answer.text)
        error = answer.json()["error"]
        assert error["param"] == "model"
        assert "the model 'someone-else' does not exist" in error["message"]
        assert "--served-model-name" in error["message"]
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = await aliased.post("/v1/chat/completions", json=chat)
    assert answer.status_code == 200 and answer.json()["model"] == "default"


async def test_openai_routes_take_the_same_parameters(client):
    """/v1/completions with OpenAI's penalties and logit bias and vLLM's extensions samples what
    /inference/v1/generate does with the same parameters."""
    plain = await vllm_tokens(client, max_tokens=8, ignore_eos=True)
    favoured = plain["token_ids"][2]
    params = {
        "frequency_penalty": 1.0,
        "presence_penalty": 0.5,
        "min_tokens": 3,
        "stop_token_ids": [plain["token_ids"][4]],
        "ignore_eos": True,
    }
    vllm = await vllm_tokens(client, max_tokens=8, logit_bias={favoured: 2.0}, **params)
    body = {
        "prompt": [PROMPT],
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "logit_bias": {str(favoured): 2.0},
        **params,
    }
    answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == vllm["token_ids"]


async def test_a_temperature_below_vllms_epsilon_samples_greedily(client):
    """vLLM samples greedily below 1e-5; dividing the logits by 1e-200 would overflow them
    (it was a 500)."""
    greedy_row = await vllm_tokens(client, temperature=0.0, max_tokens=6, seed=1)
    for tiny in (1e-200, 1e-6):
        assert await vllm_tokens(client, temperature=tiny, max_tokens=6, seed=1) == greedy_row
