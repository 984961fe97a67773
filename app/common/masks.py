"""Assistant spans of a templated conversation whose chat template has no generation tags
(most real ones: Qwen, Llama), as character ranges of the rendered text.

Linear: the conversation is rendered once more with every assistant message wrapped in
private-use markers; the markers' positions give the spans once they are removed, and the
marker-free text must equal the real rendering (else the template rewrote the content and the
per-turn prefix method below is used). A span covers the message as rendered plus the
template's end-of-turn marker (e.g. `<|im_end|>`): the policy writes it, so it is trained on.
A turn whose head the template dropped (reasoning removed from earlier turns) starts after its
assistant header."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

Conversation = list[dict[str, Any]]
Spans = list[tuple[int, int]]
_OPEN, _CLOSE, _END = "\ue000", "\ue001", "\ue002"
_PROBE = "\ue003"


def _marker(kind: str, index: int) -> str:
    return f"{kind}{index}{_END}"


class TemplateFraming(NamedTuple):
    header: str  # what opens an assistant turn (the generation prompt)
    end_of_turn: str  # what closes it, trailing whitespace excluded


class ChatTemplate(Protocol):
    """What the spans need of a model's input preparer (`app.common.inputs.InputPreparer`)."""

    def render(self, conversation: Conversation, *, generation_prompt: bool) -> str: ...

    @property
    def framing(self) -> TemplateFraming: ...


def template_framing(preparer: ChatTemplate) -> TemplateFraming:
    """The template's assistant framing, from a probe conversation (cached by the preparer)."""
    user = [{"role": "user", "content": _PROBE}]
    opened = preparer.render(user, generation_prompt=True)
    header = opened[len(preparer.render(user, generation_prompt=False)) :]
    closed = preparer.render(
        [*user, {"role": "assistant", "content": _PROBE}], generation_prompt=False
    )
    end_of_turn = closed[closed.rindex(_PROBE) + len(_PROBE) :].rstrip()
    return TemplateFraming(header, end_of_turn)


def assistant_spans(
    preparer: ChatTemplate, conversation: Conversation, text: str, *, generation_prompt: bool
) -> Spans | None:
    """Spans from one marked rendering; None when the markers cannot be trusted."""
    written = [m["content"] + (m.get("reasoning_content") or "") for m in conversation]
    if any(c in text for text in written for c in (_OPEN, _CLOSE, _END, _PROBE)):
        return None
    marked = [_marked(i, m) for i, m in enumerate(conversation)]
    rendered = preparer.render(marked, generation_prompt=generation_prompt)
    clean, places = _strip_markers(rendered)
    if clean != text:
        return None
    header, end_of_turn = preparer.framing
    spans: Spans = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant" or ("close", i) not in places:
            continue
        end = places["close", i]
        start = places.get(("open", i))
        if start is None:  # head dropped by the template: start after the assistant header
            found = clean.rfind(header, 0, end) if header else -1
            if found < 0:
                continue
            start = found + len(header)
        if end_of_turn and clean.startswith(end_of_turn, end):
            end += len(end_of_turn)
        spans.append((start, end))
    return spans


def _marked(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with markers around what it wrote. Its reasoning is the
    assistant's too: where the template renders it (before the content, in its own tags),
    no opening marker is set, and the turn is marked from its header on."""
    if message["role"] != "assistant":
        return message
    opening = "" if message.get("reasoning_content") else _marker(_OPEN, i)
    return {**message, "content": opening + message["content"] + _marker(_CLOSE, i)}


def _strip_markers(rendered: str) -> tuple[str, dict[tuple[str, int], int]]:
    """The text without markers, and where each marker stood in it."""
    parts: list[str] = []
    places: dict[tuple[str, int], int] = {}
    length, cursor = 0, 0
    while True:
        starts = [
            p for p in (rendered.find(_OPEN, cursor), rendered.find(_CLOSE, cursor)) if p >= 0
        ]
        if not starts:
            parts.append(rendered[cursor:])
            return "".join(parts), places
        at = min(starts)
        parts.append(rendered[cursor:at])
        length += at - cursor
        stop = rendered.find(_END, at)
        if stop < 0 or not rendered[at + 1 : stop].isdigit():
            return rendered, {}
        kind = "open" if rendered[at] == _OPEN else "close"
        places[kind, int(rendered[at + 1 : stop])] = length
        cursor = stop + 1


def assistant_spans_by_prefixes(
    preparer: ChatTemplate, conversation: Conversation, text: str
) -> Spans:
    """Two renders per assistant turn (quadratic); for templates that rewrite content."""
    spans: Spans = []
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        before = preparer.render(conversation[:i], generation_prompt=True) if i else ""
        through = preparer.render(conversation[: i + 1], generation_prompt=False).rstrip()
        if text.startswith(before) and text.startswith(through):
            spans.append((len(before), len(through)))
    return spans
