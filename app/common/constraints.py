"""The sampling parameters that shape the logits beyond temperature, top-k, top-p, min-p and
the repetition penalty (min-tokens, stop ids, penalties, logit bias, allowed tokens, bad
words), checked against the policy's vocabulary and resolved into `SamplingConfig` fields."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.common.failures import invalid
from app.common.sampling import Names, SamplingAsk
from app.engine.served import ServedModel

MAX_BAD_WORDS = 128
"""The most token sequences `bad_words` may become (vLLM's VLLM_MAX_NUM_BAD_WORDS default)."""


def sampling_constraints(
    served: ServedModel, ask: SamplingAsk, max_tokens: int, names: Names
) -> dict[str, Any]:
    """`SamplingConfig` keyword arguments for these parameters of `ask`, checked against
    `served` (the policy), refused by the caller's field name (`names`) where vLLM refuses
    them: out-of-vocabulary ids in `logit_bias` (keyed by ids or, as OpenAI and SGLang send
    them, their strings) and `allowed_token_ids`, an empty `allowed_token_ids`, more min- than
    max-tokens, a bad word that tokenizes to nothing."""
    vocab_size = served.backend.info.vocab_size
    if ask.min_tokens > max_tokens:
        raise invalid(
            names("min_tokens"), f"{ask.min_tokens} is more than the {max_tokens} max tokens"
        )
    bias = _token_keys(ask.logit_bias or {}, names("logit_bias"))
    _in_vocab(bias, vocab_size, names("logit_bias"))
    allowed = None
    if ask.allowed_token_ids is not None:
        allowed = tuple(ask.allowed_token_ids)
        if not allowed:
            raise invalid(names("allowed_token_ids"), "is empty: no token could be sampled")
        _in_vocab(allowed, vocab_size, names("allowed_token_ids"))
    words = tuple(ask.bad_words or ())
    return {
        "min_tokens": ask.min_tokens,
        "stop_token_ids": tuple(dict.fromkeys(ask.stop_token_ids or ())),
        "presence_penalty": ask.presence_penalty,
        "frequency_penalty": ask.frequency_penalty,
        "logit_bias": tuple(sorted(bias.items())),
        "allowed_token_ids": allowed,
        "bad_words": words,
        "bad_word_ids": (
            bad_word_ids(words, served.preparer.tokenizer, names("bad_words")) if words else ()
        ),
    }


def _token_keys(bias: Mapping[int, float] | Mapping[str, float], field: str) -> dict[int, float]:
    keyed = {}
    for key, value in bias.items():
        if isinstance(key, str) and not (key.isascii() and key.isdigit()):
            raise invalid(field, f"'{key}' is not a token id")
        keyed[int(key)] = value
    return keyed


def _in_vocab(ids: Iterable[int], vocab_size: int, field: str) -> None:
    outside = sorted(t for t in ids if not 0 <= t < vocab_size)
    if outside:
        raise invalid(
            field, f"token ids {outside[:8]} are outside the vocabulary [0, {vocab_size})"
        )


def bad_word_ids(words: tuple[str, ...], tokenizer: Any, field: str) -> tuple[tuple[int, ...], ...]:
    """Each word as vLLM's `SamplingParams.update_from_tokenizer` cuts it: its tokens as
    written (stripped on the left), and with a leading space where that gives a different
    first token and as many tokens (a word in the middle of a text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        for spaced in (False, True):
            ids = tuple(
                tokenizer.encode((" " if spaced else "") + word.lstrip(), add_special_tokens=False)
            )
            if not ids:
                if not spaced:
                    raise invalid(field, f"'{word}' tokenizes to no token")
                continue
            if not spaced or (ids[0] != sequences[-1][0] and len(ids) == len(sequences[-1])):
                sequences.append(ids)
    if len(sequences) > MAX_BAD_WORDS:
        raise invalid(field, f"{len(sequences)} token sequences; at most {MAX_BAD_WORDS}")
    return tuple(sequences)
