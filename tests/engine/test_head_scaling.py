"""Scoring through the output head in chunks equals the model's own forward, also for
architectures that scale or cap logits after the head."""

from __future__ import annotations

import pytest
import torch
import transformers

from app.engine.transformers import decode as hf_decode

SMALL = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}


@pytest.mark.parametrize(
    ("config", "model"),
    [
        ("GraniteConfig", {"logits_scaling": 4.0}),
        ("CohereConfig", {"logit_scale": 0.25}),
        ("Gemma2Config", {"final_logit_softcapping": 3.0}),
    ],
)
def test_scores_equal_the_models_forward(config, model, monkeypatch):
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(**SMALL, **model)
    causal = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # large logits, so the scaling matters
        causal.get_output_embeddings().weight.mul_(40)
    ids = [3, 14, 15, 92, 65, 35, 8, 9, 79]
    with torch.no_grad():
        log_p = causal(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    expected = [0.0] + [float(log_p[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    monkeypatch.setattr(hf_decode, "LOGIT_CHUNK_ELEMENTS", 97 * 3)
    (got,) = hf_decode.score(causal, [ids], pad_id=0)
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-4
