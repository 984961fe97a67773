"""TorchRL's sample containers as wire models (text / tokens / masks / log_probs / history,
each with prompt / response / full): their fields are the client's (`rlserve_client.types`,
one definition both sides read), with the strictness of every wire model here (`WireModel`
last: its configuration wins)."""

from __future__ import annotations

from rlserve_client import types as containers

from app.common.protocol import Message, WireModel
from app.engine import types as engine_types


class TextFields(containers.Text, WireModel):
    pass


class TokenFields(containers.Tokens, WireModel):
    pass


class LogProbFields(containers.LogProbs, WireModel):
    pass


class Masks(containers.Masks, WireModel):
    pass


class HistoryFields(WireModel):
    prompt: list[Message] | None = None
    response: list[Message] | None = None
    full: list[Message] | None = None


class VersionSpan(containers.VersionSpan, WireModel):
    pass


def wire_spans(spans: list[engine_types.VersionSpan] | None) -> list[VersionSpan] | None:
    if spans is None:
        return None
    return [VersionSpan(version=s.version, start=s.start, end=s.end) for s in spans]


VERSIONS_DESCRIPTION = (
    "Which weights sampled which response tokens: one span unless a weight update (pause "
    "mode 'keep') happened during the generation. Tokens after an update come from the new "
    "weights on the whole sequence so far (their context is recomputed)."
)


class Sample(WireModel):
    """One generated or scored sequence, in TorchRL's container layout."""

    text: TextFields | None = None
    tokens: TokenFields
    masks: Masks
    log_probs: LogProbFields | None = None
    history: HistoryFields | None = None
