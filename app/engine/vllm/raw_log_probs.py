"""Raw and processed log-probs of each sampled token from one sampling step, in vLLM's
processed mode.

vLLM's sampler returns one kind of log-prob per engine (its `logprobs_mode`); rlserve's
processed mode needs both: the processed ones (the distribution each token was drawn from)
and the raw ones (what training uses). Without this, the raw values take a second pass over
every finished sequence. With it, each step carries both, in two halves:

- In the engine's process (`carry_raw_log_probs`, applied when app.engine.vllm.worker is
  imported, which vLLM does before the model loads): vLLM's `Sampler.forward` takes the raw
  log-softmax of the logits before its processors run (some work in place), and appends one
  column to the step's log-prob tensors: the sampled token's raw log-prob, under its id
  marked as -1 - id. vLLM's frontend keeps only the first 1 + `logprobs` columns of each
  row, so an unread column changes nothing.
- In the server's process (`read_raw_log_probs`): vLLM's `LogprobsProcessor` takes the
  marked column off before it reads the rest, and each completion carries the values as
  RAW_ATTRIBUTE (None at a step that had no such column).

Steps the column skips (the frontend then falls back to a scoring pass): rows of a batch that
asks for the whole vocabulary's log-probs or for named tokens' log-probs, the speculative
bonus token, and vLLM's second model runner (whose sampler is another class; CUDA builds of
vLLM pick it where Triton is present). The raw values are those of the model's logits as the
sampler receives them, like vLLM's own raw_logprobs mode: before penalties, temperature,
bias, allowed tokens and bad words, after a structured-output mask."""

from __future__ import annotations

from typing import Any

import torch

RAW_ATTRIBUTE = "rlserve_raw_log_probs"
"""The attribute of a vLLM CompletionOutput holding each sampled token's raw log-prob."""


def carry_raw_log_probs() -> None:
    """Patch vLLM's V1 sampler (once per process) so that a processed-mode step also carries
    each sampled token's raw log-prob."""
    try:
        from vllm.v1.sample.sampler import Sampler
    except ImportError:
        return
    original = Sampler.forward
    if getattr(original, "carries_raw_log_probs", False):
        return

    def forward(
        self: Any,
        logits: torch.Tensor,
        sampling_metadata: Any,
        predict_bonus_token: bool = False,
        logprobs_mode_override: Any = None,
    ) -> Any:
        wanted = sampling_metadata.max_num_logprobs
        carry = (
            self.logprobs_mode == "processed_logprobs"
            and logprobs_mode_override is None
            and not predict_bonus_token
            and wanted is not None
            and 0 <= wanted < logits.shape[-1]
            and not sampling_metadata.logprob_token_ids
        )
        raw = self.compute_logprobs(logits) if carry else None  # (as raw_logprobs mode)
        output = original(
            self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override
        )
        tensors = output.logprobs_tensors
        if raw is None or tensors is None:
            return output
        sampled = output.sampled_token_ids[:, :1].long()
        ids = tensors.logprob_token_ids
        output.logprobs_tensors = tensors._replace(
            logprob_token_ids=torch.cat([ids, (-1 - sampled).to(ids.dtype)], dim=1),
            logprobs=torch.cat([tensors.logprobs, raw.gather(-1, sampled)], dim=1),
        )
        return output

    forward.carries_raw_log_probs = True  # type: ignore[attr-defined]
    Sampler.forward = forward


def read_raw_log_probs() -> None:
    """Patch vLLM's frontend (once per process) to take the raw column off each step's
    log-probs and hand it out on the completion."""
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.engine.output_processor import RequestState

    update = LogprobsProcessor._update_sample_logprobs
    if getattr(update, "reads_raw_log_probs", False):
        return

    def _update_sample_logprobs(self: Any, lists: Any) -> None:
        raw = self.__dict__.setdefault(RAW_ATTRIBUTE, [])
        ids = lists.logprob_token_ids
        if ids.ndim == 2 and ids.shape[1] > 1 and (ids[:, -1] < 0).all():
            raw.extend(lists.logprobs[:, -1].tolist())
            lists = lists._replace(logprob_token_ids=ids[:, :-1], logprobs=lists.logprobs[:, :-1])
        else:
            raw.extend([None] * len(ids))
        update(self, lists)

    _update_sample_logprobs.reads_raw_log_probs = True  # type: ignore[attr-defined]
    LogprobsProcessor._update_sample_logprobs = _update_sample_logprobs

    completion = RequestState._new_completion_output

    def _new_completion_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = completion(self, *args, **kwargs)
        values = getattr(self.logprobs_processor, RAW_ATTRIBUTE, None)
        if values is not None:  # (all of them: `raw_log_probs` reads cumulative outputs only)
            setattr(output, RAW_ATTRIBUTE, values)
        return output

    RequestState._new_completion_output = _new_completion_output


def raw_log_probs(completion: Any) -> list[float] | None:
    """The raw log-probs of a cumulative completion's tokens, where every step carried them."""
    values = getattr(completion, RAW_ATTRIBUTE, None)
    if values is None or len(values) != len(completion.token_ids) or None in values:
        return None
    return list(values)
