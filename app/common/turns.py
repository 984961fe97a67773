"""Token-exact multi-turn sequences: what a chat template adds between the policy's turns.

An episode's token history is never re-encoded from text. After an assistant action, only the
ids the template itself writes are appended: the rest of the assistant turn (e.g. `<|im_end|>`
then `\\n`), the messages that follow (tool results), and the next generation prompt. Tokens
the action already ended with (its end-of-turn token) are not added twice. This avoids the
retokenization drift where decode -> re-template -> encode gives other ids than the policy's."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.common.inputs import Conversation, InputPreparer

_PROBE = "\x1frlserve-probe\x1f"


def continuation_text(
    preparer: InputPreparer,
    history: Conversation,
    content: str,
    following: Conversation,
) -> str:
    """The text the template writes after `content`, the assistant message that follows
    `history`, through the generation prompt after `following` messages.

    Rendered from the real conversation when the template renders it as a continuation of the
    prompt (the common case, and exact for templates whose tool messages depend on context);
    otherwise (templates that rewrite earlier turns, e.g. drop reasoning) from a probe
    conversation, which gives the template's generic end-of-turn and message framing."""
    prompt = preparer.render(history, generation_prompt=True)
    turn = [*history, {"role": "assistant", "content": content}]
    after = preparer.render([*turn, *following], generation_prompt=True)
    if after.startswith(prompt + content):
        return after[len(prompt) + len(content) :]
    return probe_continuation(preparer, following)


def probe_continuation(preparer: InputPreparer, following: Conversation) -> str:
    """What follows an assistant turn's content in a minimal conversation."""
    probe = [{"role": "user", "content": _PROBE}, {"role": "assistant", "content": _PROBE}]
    after = preparer.render([*probe, *following], generation_prompt=True)
    return after[after.rindex(_PROBE) + len(_PROBE) :]


def continuation_ids(preparer: InputPreparer, action: list[int], text: str) -> list[int]:
    """`text` (from `continuation_text`) as ids, less the leading ids the action already ends
    with when the action ends with a special token (the policy wrote its own end of turn)."""
    ids = preparer.encode(text, special=False)
    if not action or action[-1] not in preparer.special_ids:
        return ids
    for overlap in range(min(len(action), len(ids)), 0, -1):
        if action[-overlap:] == ids[:overlap]:
            return ids[overlap:]
    return ids
