"""Assemble TorchRL-style samples from prepared inputs and backend results."""

from __future__ import annotations

from app.common.inputs import InputPreparer, Prepared
from app.common.protocol import HistoryFields, Message, Sample, TextFields


def messages(conversation: list[dict[str, str]] | None) -> list[Message] | None:
    return None if conversation is None else [Message(**m) for m in conversation]


def scored_sample(
    item: Prepared, values: list[float], preparer: InputPreparer, *, with_text: bool
) -> Sample:
    """A scored sequence; prompt/response fields appear when the split is known."""
    split = item.split()
    text = None
    if with_text:
        text = TextFields(
            full=preparer.decode(item.ids),
            prompt=None if split.prompt is None else preparer.decode(split.prompt),
            response=None if split.response is None else preparer.decode(split.response),
        )
    history = None
    if item.history is not None:
        history = HistoryFields(full=messages(item.history))
        if item.prompt_history is not None:
            history.prompt = messages(item.prompt_history)
            history.response = messages(item.history[len(item.prompt_history) :])
    return Sample(
        text=text,
        tokens=split.tokens(),
        masks=split.masks(),
        log_probs=split.log_probs(full=values),
        history=history,
    )
