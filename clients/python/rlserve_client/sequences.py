"""One token sequence split into prompt and response: the single place where TorchRL's sample
layout (tokens/masks/log-probs as prompt, response, full) is built, as plain values.

The assistant mask follows one rule per kind of sequence:
- a generated sample (generate, env steps, rollouts, `collect`): 1 exactly on the tokens this
  sample generated. Earlier assistant turns in its prompt are context here; they were counted
  as the responses of their own samples.
- a scored sequence (logprobs, KL): 1 on every assistant token of the conversation, as the
  template marks it (TorchRL's `all_assistant_mask`), or on the response of a given split.

The server and the client (its `collect`) both build samples with it; neither depends on
anything but the standard library."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Parts(Generic[T]):
    """Per-position values of one sequence, split like its ids (TorchRL's prompt, response,
    full); a part is None when the sequence has no known split or the value was not asked."""

    full: list[T] | None = None
    prompt: list[T] | None = None
    response: list[T] | None = None


@dataclass(frozen=True)
class LogProbParts(Parts[float]):
    response_processed: list[float] | None = None
    """Generation only: the sampled tokens' log-probs after the sampling processors."""


@dataclass(frozen=True)
class MaskParts:
    """TorchRL's `all_attention_mask` and `all_assistant_mask`, over the full sequence."""

    attention: list[int]
    assistant: list[int] | None


@dataclass(frozen=True)
class SequenceSplit:
    ids: list[int]
    prompt_len: int | None  # None: no known split (a whole sequence scored as it is)
    assistant_mask: list[int] | None = None

    @classmethod
    def generated(cls, prompt: Sequence[int], response: Sequence[int]) -> SequenceSplit:
        ids = [*prompt, *response]
        return cls(ids, len(prompt), [0] * len(prompt) + [1] * len(response))

    @classmethod
    def scored(
        cls, ids: list[int], prompt_len: int | None, template_mask: list[int] | None
    ) -> SequenceSplit:
        mask = template_mask
        if mask is None and prompt_len is not None:
            mask = [0] * prompt_len + [1] * (len(ids) - prompt_len)
        return cls(ids, prompt_len, mask)

    @property
    def prompt(self) -> list[int] | None:
        return None if self.prompt_len is None else self.ids[: self.prompt_len]

    @property
    def response(self) -> list[int] | None:
        return None if self.prompt_len is None else self.ids[self.prompt_len :]

    def counted(self, *, assistant_only: bool = True) -> list[int]:
        """The positions a KL sum counts: the assistant mask (every scored position but the
        first when there is none or `assistant_only` is off: position 0 has no log-prob)."""
        if assistant_only and self.assistant_mask is not None:
            return self.assistant_mask
        return [0] + [1] * (len(self.ids) - 1)

    def token_parts(self) -> Parts[int]:
        return Parts(full=self.ids, prompt=self.prompt, response=self.response)

    def mask_parts(self) -> MaskParts:
        return MaskParts(attention=[1] * len(self.ids), assistant=self.assistant_mask)

    def log_prob_parts(
        self,
        *,
        full: list[float] | None = None,
        response: list[float] | None = None,
        prompt: list[float] | None = None,
        response_processed: list[float] | None = None,
    ) -> LogProbParts:
        """Per-position values split like the ids: from `full`, or from given parts."""
        if full is not None and self.prompt_len is not None:
            prompt = full[: self.prompt_len] if prompt is None else prompt
            response = full[self.prompt_len :] if response is None else response
        if full is None and prompt is not None and response is not None:
            full = prompt + response
        return LogProbParts(
            full=full, prompt=prompt, response=response, response_processed=response_processed
        )
