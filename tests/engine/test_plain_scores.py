"""Rows that ask for log-probs alone share their output-head chunks: the answer is bit for bit
the per-row computation's, whatever else is in the batch (rows with extras, rows longer than a
chunk, one-position rows whose head product takes another kernel)."""

from __future__ import annotations

import random

import pytest
import torch

import app.engine.transformers.decode as hd
from app.engine.types import ScoreSpec


def per_row(model, items):  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        ids, mask = hd.padded([s for s, _ in items], 0, model.device, left=False)
        hidden = model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)[0]
        head = model.get_output_embeddings()
        chunk = max(1, hd.LOGIT_CHUNK_ELEMENTS // head.weight.shape[0])
        return [
            hd._row_scores(model.config, head, hidden, ids, r, s, spec, chunk)
            for r, (s, spec) in enumerate(items)
        ]


@pytest.mark.parametrize("chunk_positions", [None, 40])
def test_shared_chunks_equal_the_per_row_path_bit_for_bit(hf_model, monkeypatch, chunk_positions):
    vocab = hf_model.get_output_embeddings().weight.shape[0]
    if chunk_positions is not None:  # small chunks: groups split, long rows go alone
        monkeypatch.setattr(hd, "LOGIT_CHUNK_ELEMENTS", chunk_positions * vocab)
    rng = random.Random(0)
    for _ in range(6):
        items = []
        for _ in range(rng.choice([1, 3, 32])):
            seq = [rng.randrange(3, 250) for _ in range(rng.choice([2, 3, 17, 64, 128]))]
            spec = ScoreSpec(top_logprobs=2) if rng.random() < 0.2 else ScoreSpec()
            items.append((seq, spec))
        shared = hd.score_detailed(hf_model, items, 0)
        alone = per_row(hf_model, items)
        for a, b in zip(shared, alone, strict=True):
            assert torch.equal(a.log_probs, b.log_probs)
            assert a.start == b.start
