"""rlserve's sampling as vLLM's `SamplingParams`, and rlserve's values read back from vLLM's
outputs (sampled tokens' log-probs, prompt log-probs as a grid of each position's own and top
tokens)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from app.engine.distribution import assemble
from app.engine.types import (
    SamplingConfig,
    Scores,
    ScoreSpec,
)


def sampling_params(
    config: SamplingConfig,
    seed: int,
    *,
    streaming: bool = False,
    prompt_top: int | None = None,
) -> Any:
    """The standardized parameters as vLLM `SamplingParams` (the sampled token's log-prob, in
    the engine's logprobs_mode; prompt log-probs (raw in every mode) when asked, and with
    the `prompt_top` most likely tokens at each prompt position when that is given). Only the
    final output comes back unless `streaming` (then every step's, cumulative), and text is
    detokenized only to find stop strings. Log-probs come back flat (a few lists per request,
    not objects per token)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if prompt_top is None and config.return_prompt_log_probs:
        prompt_top = 0  # the prompt's own log-probs alone
    # top_p 0 keeps the most likely token alone (OpenAI's meaning, and the transformers
    # backend's), which vLLM, taking top_p in (0, 1], says as top_k 1.
    top_p, top_k = config.top_p, config.top_k or 0
    if top_p == 0:
        top_p, top_k = 1.0, 1
    return SamplingParams(
        output_kind=RequestOutputKind.CUMULATIVE if streaming else final_only(),
        detokenize=bool(config.stop_sequences),
        n=1,
        max_tokens=config.max_new_tokens,
        temperature=config.temperature if config.do_sample else 0.0,
        top_p=top_p,
        top_k=top_k,
        min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        seed=seed,
        stop=list(config.stop_sequences) or None,
        include_stop_str_in_output=True,
        ignore_eos=config.ignore_eos,
        min_tokens=config.min_tokens,
        stop_token_ids=list(config.stop_token_ids) or None,
        presence_penalty=config.presence_penalty,
        frequency_penalty=config.frequency_penalty,
        logit_bias=dict(config.logit_bias) or None,
        allowed_token_ids=None
        if config.allowed_token_ids is None
        else list(config.allowed_token_ids),
        bad_words=list(config.bad_words) or None,
        logprobs=0,
        prompt_logprobs=prompt_top,
        flat_logprobs=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )


def returned_log_probs(flat: Any, length: int, vocab: int) -> torch.Tensor:
    """[length - 1, vocab]: the log-probs vLLM returned for positions 1… (flat layout), -inf
    where it returned none."""
    dense = torch.full((length - 1, vocab), float("-inf"))
    for row in range(length - 1):
        span = slice(flat.start_indices[row + 1], flat.end_indices[row + 1])
        dense[row, torch.tensor(flat.token_ids[span])] = torch.tensor(flat.logprobs[span])
    return dense


def own_log_probs(flat: Any, begin: int, end: int) -> list[float]:
    """Positions [begin, end) of vLLM's flat sample log-probs: each position's own (sampled)
    token comes first, before any top-k."""
    return [flat.logprobs[flat.start_indices[p]] for p in range(begin, end)]


@dataclasses.dataclass
class PromptGrid:
    """vLLM's flat prompt log-probs of a sequence, positions 1… as rows: each row is the
    position's own token, then the k most likely tokens in order (possibly itself again)."""

    rows: int
    k: int
    token_ids: list[int]
    log_probs: list[float]
    ranks: list[int]

    @property
    def own(self) -> list[float]:
        """The log-prob of each position's own token."""
        return self.log_probs[:: self.k + 1]

    def scores(self, spec: ScoreSpec) -> Scores:
        part = {"log_probs": torch.tensor(self.own, dtype=torch.float32)}
        if spec.ranks:
            part["ranks"] = torch.tensor(self.ranks[:: self.k + 1])
        if self.k:
            shape = (self.rows, self.k + 1)
            part["top_ids"] = torch.tensor(self.token_ids).view(shape)[:, 1:]
            part["top_log_probs"] = torch.tensor(self.log_probs).view(shape)[:, 1:]
        return assemble([part], spec.start, self.rows + 1)


def prompt_grid(flat: Any, length: int, k: int) -> PromptGrid:
    rows = length - 1
    if len(flat.logprobs) != rows * (k + 1):  # (position 0 has none)
        raise RuntimeError(
            f"vLLM returned {len(flat.logprobs)} prompt log-probs for {rows} positions with "
            f"top {k}; expected {rows * (k + 1)}"
        )
    return PromptGrid(
        rows=rows,
        k=k,
        token_ids=flat.token_ids,
        log_probs=flat.logprobs,
        ranks=flat.ranks,
    )


def prompt_scores(flat: Any, length: int, spec: ScoreSpec) -> Scores:
    """Log-probs, top-k and ranks of a whole sequence, read off vLLM's prompt log-probs."""
    return prompt_grid(flat, length, spec.top_logprobs).scores(spec)


def final_only() -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.FINAL_ONLY
