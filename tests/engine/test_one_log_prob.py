"""Decoding and scoring take a log-prob one way (`app.engine.distribution.log_probs_of`): given
the same logits, the log-probs a token was sampled with, raw and processed, and a prompt's are
bit for bit what scoring gives the same tokens.

The model here is a bigram table whose logits are computed exactly whatever the batch, padding
or cache (a one-hot row times the table: one nonzero product in each sum), so any difference
left is the log-prob arithmetic's. Its logits are large, as a trained model's confident tokens
are: there `log_softmax` and logit minus logsumexp round differently."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from app.engine.transformers import decode as hf_decode
from app.engine.types import GenerateItem, SamplingConfig, ScoreSpec

VOCAB = 2048


class _Cache:
    def reorder_cache(self, index: torch.Tensor) -> None:
        pass


class Bigram(torch.nn.Module):
    """A causal LM whose next-token logits depend on the current token alone."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.config = SimpleNamespace()
        self.head = torch.nn.Linear(VOCAB, VOCAB, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(VOCAB, VOCAB, generator=generator) * 6)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(input_ids, VOCAB).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> SimpleNamespace:
        hidden = self._hidden(input_ids)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.head(hidden), past_key_values=_Cache(), cache=None)

    def get_decoder(self) -> Any:
        return lambda input_ids, **_: (self._hidden(input_ids),)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head


def test_sampled_log_probs_are_the_scores_of_the_same_tokens_bit_for_bit():
    model = Bigram()
    sampled = SamplingConfig(
        max_new_tokens=24, temperature=0.7, top_p=0.9, ignore_eos=True, return_prompt_log_probs=True
    )
    greedy = SamplingConfig.resolve(24, greedy=True, temperature=None, ignore_eos=True)
    prompts = [(5, 9, 13), (700, 3), (5, 9, 13), (1500, 2, 40, 41, 42)]
    items = [
        GenerateItem(prompt, sampled if row != 1 else greedy, seed=row)
        for row, prompt in enumerate(prompts)
    ]
    generations = hf_decode.generate(
        model, items, pad_id=0, eos_ids=frozenset(), decode=lambda ids: ""
    )
    for item, generation in zip(items, generations, strict=True):
        config = item.config
        sequence = [*item.prompt_ids, *generation.token_ids]
        spec = ScoreSpec(temperature=config.temperature, top_p=config.top_p, start=1)
        (scores,) = hf_decode.score_detailed(model, [(sequence, spec)], pad_id=0)
        response = slice(len(item.prompt_ids), len(sequence))
        assert generation.log_probs == scores.log_probs[response].tolist()
        if spec.processed:  # the extras run from position 1: index p - 1 is position p
            processed = scores.processed[response.start - 1 : response.stop - 1].tolist()
            assert generation.processed_log_probs == processed
            assert generation.prompt_log_probs == scores.log_probs[: response.start].tolist()
        else:
            assert generation.processed_log_probs == generation.log_probs
    # ... where `log_softmax` of the same logits gives other bits: the test can tell.
    rounded_otherwise = 0
    for item, generation in zip(items, generations, strict=True):
        sequence = torch.tensor([[*item.prompt_ids, *generation.token_ids]])
        log_softmax = model(sequence).logits[0, :-1].log_softmax(-1)
        picked = log_softmax.gather(-1, sequence[0, 1:, None]).squeeze(-1)
        rounded_otherwise += picked[len(item.prompt_ids) - 1 :].tolist() != generation.log_probs
    assert rounded_otherwise > 0
