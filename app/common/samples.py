"""Assemble TorchRL-style samples from prepared inputs and backend results: the wire forms
of the sample layout that `rlserve_client.sequences` builds."""

from __future__ import annotations

from rlserve_client.sequences import LogProbParts, MaskParts, Parts

from app.common.containers import (
    HistoryFields,
    LogProbFields,
    Masks,
    Sample,
    TextFields,
    TokenFields,
)
from app.common.inputs import InputPreparer, Prepared
from app.common.protocol import Message


def token_fields(parts: Parts[int]) -> TokenFields:
    return TokenFields(full=parts.full, prompt=parts.prompt, response=parts.response)


def mask_fields(masks: MaskParts) -> Masks:
    return Masks(all_attention_mask=masks.attention, all_assistant_mask=masks.assistant)


def log_prob_fields(parts: LogProbParts) -> LogProbFields:
    return LogProbFields(
        full=parts.full,
        prompt=parts.prompt,
        response=parts.response,
        response_processed=parts.response_processed,
    )


def messages(conversation: list[dict[str, str]] | None) -> list[Message] | None:
    # (the service's own conversations, of checked messages: built, not validated again)
    return (
        None
        if conversation is None
        else [Message.model_construct(role=m["role"], content=m["content"]) for m in conversation]
    )


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
        tokens=token_fields(split.token_parts()),
        masks=mask_fields(split.mask_parts()),
        log_probs=log_prob_fields(split.log_prob_parts(full=values)),
        history=history,
    )
