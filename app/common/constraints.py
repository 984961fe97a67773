"""The sampling parameters the vLLM, SGLang and OpenAI routes take beyond rlserve's own
(min-tokens, stop ids, penalties, logit bias, allowed tokens, bad words), checked against the
policy's vocabulary and resolved into `SamplingConfig` fields."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from app.common.failures import invalid
from app.engine.served import ServedModel

MAX_BAD_WORDS = 128
"""The most token sequences `bad_words` may become (vLLM's VLLM_MAX_NUM_BAD_WORDS default)."""


def sampling_constraints(
    served: ServedModel,
    *,
    prefix: str,
    min_tokens: int = 0,
    max_tokens: int | None = None,
    stop_token_ids: Iterable[int] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logit_bias: Mapping[int, float] | Mapping[str, float] | None = None,
    allowed_token_ids: Iterable[int] | None = None,
    bad_words: Iterable[str] | None = None,
    min_tokens_field: str = "min_tokens",
) -> dict[str, Any]:
    """`SamplingConfig` keyword arguments for these parameters, checked against `served` (the
    policy), refused by field name (under `prefix`, e.g. "sampling_params.") where vLLM
    refuses them: out-of-vocabulary ids in `logit_bias` (keyed by ids or, as OpenAI and SGLang
    send them, their strings) and `allowed_token_ids`, an empty `allowed_token_ids`, more min-
    than max-tokens, a bad word that tokenizes to nothing."""
    vocab_size = served.backend.info.vocab_size
    if max_tokens is not None and min_tokens > max_tokens:
        raise invalid(
            prefix + min_tokens_field, f"{min_tokens} is more than the {max_tokens} max tokens"
        )
    bias = _token_keys(logit_bias or {}, prefix + "logit_bias")
    _in_vocab(bias, vocab_size, prefix + "logit_bias")
    allowed = None
    if allowed_token_ids is not None:
        allowed = tuple(allowed_token_ids)
        if not allowed:
            raise invalid(prefix + "allowed_token_ids", "is empty: no token could be sampled")
        _in_vocab(allowed, vocab_size, prefix + "allowed_token_ids")
    words = tuple(bad_words or ())
    return {
        "min_tokens": min_tokens,
        "stop_token_ids": tuple(dict.fromkeys(stop_token_ids or ())),
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "logit_bias": tuple(sorted(bias.items())),
        "allowed_token_ids": allowed,
        "bad_words": words,
        "bad_word_ids": (
            bad_word_ids(words, served.preparer.tokenizer, prefix + "bad_words") if words else ()
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
