"""Assemble TorchRL-style samples from prepared inputs and backend results."""

from __future__ import annotations

from app.common.inputs import InputPreparer, Prepared
from app.common.protocol import (
    HistoryFields,
    LogProbFields,
    Masks,
    Message,
    Sample,
    TextFields,
    TokenFields,
)
from app.engine.types import Generation


def _messages(conversation: list[dict[str, str]] | None) -> list[Message] | None:
    return None if conversation is None else [Message(**m) for m in conversation]


def scored_sample(
    item: Prepared, values: list[float], preparer: InputPreparer, *, with_text: bool
) -> Sample:
    """A scored sequence; prompt/response fields appear when the split is known."""
    cut = item.prompt_len
    split = cut is not None
    mask = item.assistant_mask
    if mask is None and split:
        mask = [0] * cut + [1] * (len(item.ids) - cut)  # type: ignore[operator]
    text = None
    if with_text:
        text = TextFields(
            full=preparer.decode(item.ids),
            prompt=preparer.decode(item.ids[:cut]) if split else None,
            response=preparer.decode(item.ids[cut:]) if split else None,
        )
    history = None
    if item.history is not None:
        history = HistoryFields(full=_messages(item.history))
        if item.prompt_history is not None:
            history.prompt = _messages(item.prompt_history)
            history.response = _messages(item.history[len(item.prompt_history) :])
    return Sample(
        text=text,
        tokens=TokenFields(
            full=item.ids,
            prompt=item.ids[:cut] if split else None,
            response=item.ids[cut:] if split else None,
        ),
        masks=Masks(all_attention_mask=[1] * len(item.ids), all_assistant_mask=mask),
        log_probs=LogProbFields(
            full=values,
            prompt=values[:cut] if split else None,
            response=values[cut:] if split else None,
        ),
        history=history,
    )


def generated_sample(
    prompt: Prepared,
    generation: Generation,
    preparer: InputPreparer,
    *,
    with_log_probs: bool,
    skip_special_tokens: bool,
) -> dict[str, object]:
    """The fields of one generated sample (the caller adds finish_reason)."""
    response = generation.token_ids
    full = prompt.ids + response
    prompt_mask = prompt.assistant_mask or [0] * len(prompt.ids)
    log_probs = None
    if with_log_probs:
        log_probs = LogProbFields(
            response=generation.log_probs, response_processed=generation.processed_log_probs
        )
        if generation.prompt_log_probs is not None:
            log_probs.prompt = generation.prompt_log_probs
            log_probs.full = generation.prompt_log_probs + generation.log_probs
    history = None
    if prompt.history is not None:
        content = preparer.decode(response, skip_special=True)
        reply = [{"role": "assistant", "content": content}]
        history = HistoryFields(
            prompt=_messages(prompt.history),
            response=_messages(reply),
            full=_messages(prompt.history + reply),
        )
    return {
        "text": TextFields(
            prompt=preparer.decode(prompt.ids),
            response=preparer.decode(response, skip_special=skip_special_tokens),
            full=preparer.decode(full),
        ),
        "tokens": TokenFields(prompt=prompt.ids, response=response, full=full),
        "masks": Masks(
            all_attention_mask=[1] * len(full),
            all_assistant_mask=prompt_mask + [1] * len(response),
        ),
        "log_probs": log_probs,
        "history": history,
    }
