"""/v1/logprobs extras (top-k, entropy, processed log-probs, candidate ids, mismatch report)
against an independent computation on the full logits of the same model."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from app.engine.transformers import decode as hf_decode
from tests.conftest import assert_close

TOL = 1e-5
PROMPT = [5, 77, 12, 200, 3]
RESPONSE = [9, 41, 8, 130, 66, 2, 17]


async def score(client: httpx.AsyncClient, status: int = 200, **body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post("/v1/logprobs", json=body)
    assert response.status_code == status, response.text
    return response.json()


def log_softmax_rows(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, V]: the distribution predicting tokens 1… (an independent forward)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].double()
    return logits.log_softmax(-1)


def processed_log_probs(log_p: torch.Tensor, temperature: float, top_k: int, top_p: float):  # type: ignore[no-untyped-def]
    """Written out separately from the server: scale, keep the k largest, then keep tokens
    (most likely first) while the mass before them is at most p."""
    scaled = (log_p / temperature).log_softmax(-1)
    out = torch.full_like(scaled, -math.inf)
    removed = []
    for row in range(scaled.shape[0]):
        order = scaled[row].argsort(descending=True)[:top_k]
        probs = scaled[row, order].softmax(-1)  # renormalized over the top k
        before = 0.0
        keep = []
        for rank, token in enumerate(order.tolist()):
            if rank > 0 and before > top_p:
                break
            keep.append(token)
            before += float(probs[rank])
        kept = torch.tensor(keep)
        out[row, kept] = scaled[row, kept] - scaled[row, kept].logsumexp(0)
        removed.append(1.0 - float(scaled[row, kept].exp().sum()))
    return out, removed


async def test_top_k_entropy_and_candidates_equal_the_full_distribution(client, hf_model):
    ids = PROMPT + RESPONSE
    candidates = [0, 5, 41, 258]
    body = await score(
        client,
        prompt_tokens=[PROMPT],
        response_tokens=[RESPONSE],
        top_logprobs=5,
        entropy=True,
        token_ids=candidates,
    )
    (out,) = body["outputs"]
    assert out["span"] == "response" and "processed" not in out
    log_p = log_softmax_rows(hf_model, ids)[len(PROMPT) - 1 :]  # rows predicting the response
    top = log_p.topk(5, dim=-1)
    assert len(out["top_logprobs"]["ids"]) == len(RESPONSE)
    for row in range(len(RESPONSE)):
        assert_close(out["top_logprobs"]["log_probs"][row], top.values[row].tolist(), TOL)
        assert out["top_logprobs"]["ids"][row] == top.indices[row].tolist()
    entropy = torch.distributions.Categorical(logits=log_p).entropy()
    assert_close(out["entropy"], entropy.tolist(), TOL)
    for row in range(len(RESPONSE)):
        assert_close(out["token_id_log_probs"][row], log_p[row, candidates].tolist(), TOL)
    # the raw log-probs are unchanged by asking for more
    expected = log_p.gather(-1, torch.tensor(RESPONSE)[:, None]).squeeze(-1)
    assert_close(out["log_probs"]["response"], expected.tolist(), TOL)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.7, 1000, 1.0), (1.3, 20, 0.9)])
async def test_processed_log_probs_follow_temperature_top_k_and_top_p(
    client, hf_model, temperature, top_k, top_p
):
    ids = PROMPT + RESPONSE
    body = await score(client, tokens=[ids], temperature=temperature, top_k=top_k, top_p=top_p)
    (out,) = body["outputs"]
    assert out["span"] == "full"
    processed, removed = processed_log_probs(
        log_softmax_rows(hf_model, ids), temperature, top_k, top_p
    )
    got = out["processed"]["log_probs"]
    assert got[0] is None and out["processed"]["truncated_mass"][0] is None
    for position in range(1, len(ids)):
        want = float(processed[position - 1, ids[position]])
        if math.isinf(want):
            assert got[position] is None, position
        else:
            assert got[position] == pytest.approx(want, abs=TOL), position
    assert_close(out["processed"]["truncated_mass"][1:], removed, TOL)
    if top_p == 1.0:  # temperature alone removes nothing
        assert all(abs(m) < TOL for m in removed)


async def test_full_span_rows_line_up_with_tokens_full(client, hf_model):
    ids = PROMPT + RESPONSE
    body = await score(
        client, prompt_tokens=[PROMPT], response_tokens=[RESPONSE], span="full", top_logprobs=2
    )
    (out,) = body["outputs"]
    rows = out["top_logprobs"]["log_probs"]
    assert out["span"] == "full" and len(rows) == len(ids) and rows[0] is None
    top = log_softmax_rows(hf_model, ids).topk(2, dim=-1).values
    for position in range(1, len(ids)):
        assert_close(rows[position], top[position - 1].tolist(), TOL)


async def test_the_mismatch_report_against_given_log_probs(client):
    plain = (await score(client, prompt_tokens=[PROMPT], response_tokens=[RESPONSE]))["outputs"]
    ours = plain[0]["log_probs"]["response"]
    shift = [0.0, 0.05, -0.2, 0.0, 0.5, -0.01, 0.3]
    reference = [a - s for a, s in zip(ours, shift, strict=True)]
    body = await score(
        client,
        prompt_tokens=[PROMPT],
        response_tokens=[RESPONSE],
        reference_log_probs=[reference],
        mismatch_threshold=0.1,
    )
    report = body["outputs"][0]["mismatch"]
    assert_close(report["difference"], shift, 1e-6)
    assert report["max_abs"] == pytest.approx(0.5, abs=1e-6)
    assert report["mean_abs"] == pytest.approx(sum(abs(s) for s in shift) / 7, abs=1e-6)
    weights = [math.exp(s) for s in shift]
    ess = sum(weights) ** 2 / sum(w * w for w in weights)
    assert report["effective_sample_size"] == pytest.approx(ess, rel=1e-6)
    assert report["num_tokens"] == 7 and report["num_beyond_threshold"] == 3
    same = await score(
        client, prompt_tokens=[PROMPT], response_tokens=[RESPONSE], reference_log_probs=[ours]
    )
    exact = same["outputs"][0]["mismatch"]
    assert exact["max_abs"] == 0.0 and exact["effective_sample_size"] == pytest.approx(7.0)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tokens": [[1, 2, 3]], "top_logprobs": 65}, "top_logprobs"),
        ({"tokens": [[1, 2, 3]], "token_ids": [4, 100000]}, "token_ids[1]"),
        ({"tokens": [[1, 2, 3]], "token_ids": [-1]}, "token_ids[0]"),
        ({"tokens": [[1, 2, 3]], "span": "response", "entropy": True}, "span"),
        ({"tokens": [[1, 2, 3]], "reference_log_probs": [[0.0, 1.0]]}, "reference_log_probs[0]"),
        ({"tokens": [[1, 2, 3]], "reference_log_probs": []}, "reference_log_probs"),
        ({"tokens": [[1, 2, 3]], "temperature": 0}, "temperature"),
    ],
)
async def test_bad_asks_are_422_naming_the_field(client, body, param):
    error = (await score(client, 422, **body))["error"]
    assert param in (error["param"] or ""), error
    if body.get("token_ids") == [4, 100000]:  # said as every vocabulary refusal is
        assert "100000 is outside the vocabulary [0, " in error["message"]


async def test_chunked_positions_give_the_same_answers(client, backend_name, monkeypatch):
    if backend_name != "transformers":
        pytest.skip("vLLM returns whole sequences; its bound is tested below")
    ask = {"tokens": [PROMPT + RESPONSE], "top_logprobs": 3, "entropy": True, "top_k": 7}
    whole = await score(client, **ask)
    monkeypatch.setattr(hf_decode, "LOGIT_CHUNK_ELEMENTS", 2 * 259)  # two positions a chunk
    chunked = await score(client, **ask)
    (a,), (b,) = whole["outputs"], chunked["outputs"]
    assert_close(a["log_probs"]["full"], b["log_probs"]["full"], TOL)
    assert_close(a["entropy"][1:], b["entropy"][1:], TOL)
    assert a["top_logprobs"]["ids"] == b["top_logprobs"]["ids"]
    for x, y in zip(a["processed"]["log_probs"], b["processed"]["log_probs"], strict=True):
        assert (x is None) == (y is None) and (x is None or abs(x - y) < TOL)


async def test_vllm_refuses_full_distribution_work_beyond_its_bound(client, backend_name):
    if backend_name != "vllm":
        pytest.skip("the transformers backend chunks instead")
    from app.engine.vllm import backend as vllm_backend

    limit = vllm_backend.FULL_VOCAB_ELEMENTS
    try:
        vllm_backend.FULL_VOCAB_ELEMENTS = 259 * 8
        error = (await score(client, 413, tokens=[list(range(1, 20))], entropy=True))["error"]
        assert error["param"] == "entropy" and "at most 8 tokens" in error["message"], error
        # top-k alone needs no whole distribution
        await score(client, tokens=[list(range(1, 20))], top_logprobs=3)
    finally:
        vllm_backend.FULL_VOCAB_ELEMENTS = limit


async def test_generation_reports_top_k_and_entropy_at_every_generated_step(client, hf_model):
    response = await client.post(
        "/v1/generate",
        json={
            "tokens": [PROMPT],
            "max_new_tokens": 6,
            "n": 2,
            "seed": 11,
            "ignore_eos": True,
            "top_logprobs": 4,
            "entropy": True,
        },
    )
    assert response.status_code == 200, response.text
    for sample in response.json()["outputs"][0]:
        generated = sample["tokens"]["response"]
        log_p = log_softmax_rows(hf_model, PROMPT + generated)[len(PROMPT) - 1 :]
        top = log_p.topk(4, dim=-1)
        assert len(sample["top_logprobs"]["ids"]) == len(sample["entropy"]) == len(generated) == 6
        for step in range(len(generated)):
            assert sample["top_logprobs"]["ids"][step] == top.indices[step].tolist()
            assert_close(sample["top_logprobs"]["log_probs"][step], top.values[step].tolist(), TOL)
        entropy = torch.distributions.Categorical(logits=log_p).entropy()
        assert_close(sample["entropy"], entropy.tolist(), TOL)
        # the scoring pass agrees with what generation reported for the sampled tokens
        sampled = log_p.gather(-1, torch.tensor(generated)[:, None]).squeeze(-1)
        assert_close(sample["log_probs"]["response"], sampled.tolist(), 1e-4)
    plain = await client.post("/v1/generate", json={"tokens": [PROMPT], "max_new_tokens": 2})
    assert "top_logprobs" not in plain.json()["outputs"][0][0]  # nothing unasked is computed
    too_many = await client.post(
        "/v1/generate", json={"tokens": [PROMPT], "max_new_tokens": 2, "top_logprobs": 65}
    )
    assert too_many.status_code == 422 and too_many.json()["error"]["param"] == "top_logprobs"
