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


def messages(conversation: list[dict[str, str]] | None) -> list[Message] | None:
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
        history = HistoryFields(full=messages(item.history))
        if item.prompt_history is not None:
            history.prompt = messages(item.prompt_history)
            history.response = messages(item.history[len(item.prompt_history) :])
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
