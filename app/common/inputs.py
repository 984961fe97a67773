"""Turn request inputs (messages, text, tokens, prompt/response splits) into exact token ids,
texts and assistant masks, and check them against the model's vocabulary and length."""

from __future__ import annotations

import contextlib
import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import tokenizers
from rlserve_client.sequences import SequenceSplit

from app.common.failures import TooLarge, invalid
from app.common.lane import Lane
from app.common.masks import (
    Conversation,
    TemplateFraming,
    assistant_spans,
    assistant_spans_by_prefixes,
    template_framing,
)
from app.common.messages import arguments_as_object, plain_messages, template_kwargs

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Templates that read the clock or draw random values render differently each time: their
# renders are not remembered.
_UNREPEATABLE = re.compile(r"strftime_now|\brandom\b")
RENDERS_KEPT = 512
T = TypeVar("T")
Item = TypeVar("Item")
_FIELD: ContextVar[str] = ContextVar("rlserve_input_field", default="input")
"""The request field of the text being prepared (`naming`), for a refusal to name."""


@contextlib.contextmanager
def naming(field: str) -> Iterator[None]:
    """Texts prepared inside come from request field `field` (what a refusal names)."""
    token = _FIELD.set(field)
    try:
        yield
    finally:
        _FIELD.reset(token)


def each_named(field: str, items: Iterable[Item], prepare: Callable[[Item], T]) -> list[T]:
    """`prepare` of each item, the item's texts named `field[i]` (`naming`)."""
    prepared = []
    for i, item in enumerate(items):
        with naming(f"{field}[{i}]"):
            prepared.append(prepare(item))
    return prepared


def text_volume(value: Any) -> int:
    """Characters of every string in a request's input (lists, dicts and wire models walked):
    what tokenizing it costs, about (`InputPreparer.off_loop`'s order). Runs on the event
    loop, so a list of numbers (token ids) is passed over whole, never walked."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(text_volume(v) for v in value.values())
    if isinstance(value, list | tuple):
        if not value or isinstance(value[0], int | float):
            return 0
        return sum(text_volume(v) for v in value)
    fields = getattr(type(value), "model_fields", None)
    if fields is not None:
        return sum(text_volume(getattr(value, name, None)) for name in fields)
    return 0


@dataclass
class Prepared:
    """One input sequence. `prompt_len` splits `ids` when a prompt/response split is known."""

    ids: list[int]
    prompt_len: int | None = None
    assistant_mask: list[int] | None = None
    text: str | None = None
    prompt_text: str | None = None
    history: Conversation | None = None
    prompt_history: Conversation | None = None

    def split(self) -> SequenceSplit:
        return SequenceSplit.scored(self.ids, self.prompt_len, self.assistant_mask)


class InputPreparer:
    """Tokenization and chat templating for one model."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        # Tokenizing and templating a large request takes milliseconds to seconds: it runs on
        # this one thread (one per model, so the tokenizer is never used concurrently),
        # never on the event loop, the cheapest request waiting first; and no text is
        # tokenized that is sure to be too long (`check_size`).
        self._thread = Lane("tokenizer", by_cost=True)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        template = getattr(tokenizer, "chat_template", None) or ""
        self.has_chat_template = bool(template)
        # Renders remembered, most recent last: an episode's next turn renders the conversation
        # its last turn rendered, and Jinja is the largest cost of a step on a long history.
        self._renders: OrderedDict[str, str] = OrderedDict()
        self._rendered_template: Any = None  # the template the renders are of, and whether
        self._remembering = False  # its renders repeat (set at the first render)
        self._renders_lock = threading.Lock()
        self.has_generation_tags = bool(_GENERATION_TAG.search(template))
        self.special_ids: set[int] = set(getattr(tokenizer, "all_special_ids", None) or [])
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            pad = getattr(tokenizer, "eos_token_id", None)
        self.pad_token_id: int = int(pad) if pad is not None else 0

    def close(self) -> None:
        """Stop the tokenizer thread once the calls already queued have run (at shutdown)."""
        self._thread.close(wait=False)

    async def off_loop(
        self, fn: Callable[..., T], *args: Any, cost: float = 0.0, **kwargs: Any
    ) -> T:
        """`fn(*args, **kwargs)` on the tokenizer thread (for work that tokenizes or decodes),
        before the calls waiting that `cost` more (`text_volume` of what it prepares), so a
        short request is never queued behind a long one."""
        return await self._thread.run(functools.partial(fn, *args, **kwargs), cost=cost)

    # -- text and templates -------------------------------------------------------------

    @cached_property
    def framing(self) -> TemplateFraming:
        """The chat template's assistant header and end-of-turn marker (probed once)."""
        return template_framing(self)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry in characters: a text of n characters encodes to at
        least n / max_token_chars tokens, so a length bound can refuse it before encoding."""
        vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
        return max((len(token) for token in vocab), default=1) or 1

    def certainly_longer(self, text: str, tokens: int) -> bool:
        """Whether `text` is sure to encode to more than `tokens` tokens (no encoding done)."""
        return len(text) > tokens * self.max_token_chars

    def check_size(self, text: str) -> None:
        """422 naming the field being prepared (`naming`) for a text sure to encode to more
        tokens than the model takes: refused by its length, before the tokenizer spends
        seconds on it (every text is checked so before it is encoded)."""
        if self.certainly_longer(text, self.max_model_len):
            raise invalid(
                _FIELD.get(),
                f"{len(text)} characters are more than the model's maximum length of "
                f"{self.max_model_len} tokens can hold (a token of its tokenizer holds at most "
                f"{self.max_token_chars} characters): refused before tokenizing",
            )

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        self.check_size(text)
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def decode(self, ids: list[int], *, skip_special: bool = False) -> str:
        backend = self._plain_decoder
        if backend is not None and isinstance(ids, list):
            return str(backend.decode(ids, skip_special_tokens=skip_special))
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))

    @cached_property
    def _plain_decoder(self) -> Any:
        """The fast tokenizer's own `tokenizers.Tokenizer` when transformers' decode adds
        nothing to its answer (no clean-up of spaces), else None. Called directly, a decode
        skips transformers' conversion of every id, half its cost on a long history (an
        environment step decodes the whole episode for its observation)."""
        backend = getattr(self.tokenizer, "_tokenizer", None)
        if not isinstance(backend, tokenizers.Tokenizer):
            return None
        if getattr(self.tokenizer, "clean_up_tokenization_spaces", True):
            return None
        return backend

    def render(
        self,
        conversation: Conversation,
        *,
        generation_prompt: bool,
        tools: Any = None,
        options: dict[str, Any] | None = None,
    ) -> str:
        """The chat template's text for `conversation` (the last RENDERS_KEPT remembered);
        `options` are more variables for the template (vLLM's chat_template_kwargs, such as
        Qwen3's enable_thinking, and continue_final_message)."""
        key = self._render_key(conversation, generation_prompt, tools, options)
        if key is not None:
            with self._renders_lock:
                text = self._renders.get(key)
                if text is not None:
                    self._renders.move_to_end(key)
                    return text
        text = str(
            self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                tools=tools,
                **(options or {}),
            )
        )
        self.check_size(text)  # (rendering is quick: tokenizing it is what costs)
        if key is not None:
            with self._renders_lock:
                self._renders[key] = text
                if len(self._renders) > RENDERS_KEPT:
                    self._renders.popitem(last=False)
        return text

    def _render_key(
        self,
        conversation: Conversation,
        generation_prompt: bool,
        tools: Any,
        options: dict[str, Any] | None,
    ) -> str | None:
        """The render's inputs as one string; None when renders are not remembered: inputs
        that are not plain JSON, or a template that reads the clock or draws random values."""
        template = getattr(self.tokenizer, "chat_template", None)
        if template is not self._rendered_template:  # new or replaced: forget its renders
            with self._renders_lock:
                self._renders.clear()
                self._rendered_template = template
                self._remembering = not _UNREPEATABLE.search(str(template or ""))
        if not self._remembering:
            return None
        try:
            return json.dumps(
                [conversation, generation_prompt, tools, options or {}], ensure_ascii=False
            )
        except (TypeError, ValueError):
            return None

    def knows_role(self, role: str) -> bool:
        """Whether the chat template names `role` (a template that does not may drop it)."""
        return f"'{role}'" in self._template_source or f'"{role}"' in self._template_source

    @property
    def _template_source(self) -> str:
        return str(getattr(self.tokenizer, "chat_template", None) or "")

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def template(
        self,
        conversation: Conversation,
        *,
        generation_prompt: bool,
        tools: Any = None,
        options: dict[str, Any] | None = None,
    ) -> Prepared:
        """Template a conversation (with tool definitions for templates that take them); the
        assistant mask covers what the assistant wrote: every token of each assistant message
        as rendered and its end-of-turn token (from character offsets of the assistant turns),
        and whatever the template's generation tags mark, where it has them."""
        given, conversation = conversation, self.as_template_takes(conversation)
        text = self.render(
            conversation, generation_prompt=generation_prompt, tools=tools, options=options
        )
        # (transformers marks no assistant tokens in a final message left open)
        if self.has_generation_tags and not (options or {}).get("continue_final_message"):
            out = self.tokenizer.apply_chat_template(
                conversation,
                tokenize=True,
                return_dict=True,
                add_generation_prompt=generation_prompt,
                return_assistant_tokens_mask=True,
                tools=tools,
                **(options or {}),
            )
            ids, tagged = list(out["input_ids"]), list(out["assistant_masks"])
            # The tags' token mask ends on the token holding the span's last character's
            # first byte (a multi-byte character's other bytes are left out), and leaves out
            # the end-of-turn token when the tags close before it: the offsets mask has both.
            offsets = self._mask_from_offsets(conversation, text, generation_prompt)
            if len(offsets) == len(tagged):
                mask = [int(a or b) for a, b in zip(tagged, offsets, strict=True)]
            else:
                mask = tagged
        else:
            ids = self.encode(text, special=False)
            mask = self._mask_from_offsets(conversation, text, generation_prompt)
        return Prepared(ids=ids, assistant_mask=mask, text=text, history=given)

    def as_template_takes(self, conversation: Conversation) -> Conversation:
        """`conversation` as the template gets it:
        - a developer message (OpenAI's system instructions) as a system one where the
          template does not name the developer role, which it would otherwise drop or
          misplace;
        - tool-call arguments sent as text (OpenAI's wire form) as that exact text where the
          template writes string arguments as they are (Qwen's, Hermes'), so a reply sent back
          renders the tokens the model sampled; elsewhere as the object they encode, which
          templates serialise themselves (`tojson`)."""
        developer = not self.knows_role("developer")
        strings = self.takes_string_arguments
        out = []
        for message in conversation:
            if developer and message.get("role") == "developer":
                message = {**message, "role": "system"}
            if not strings and message.get("tool_calls"):
                message = {
                    **message,
                    "tool_calls": [arguments_as_object(c) for c in message["tool_calls"]],
                }
            out.append(message)
        return out

    @cached_property
    def takes_string_arguments(self) -> bool:
        """Whether the chat template writes tool-call arguments given as a string verbatim."""
        return "arguments is string" in (getattr(self.tokenizer, "chat_template", None) or "")

    def _mask_from_offsets(
        self, conversation: Conversation, text: str, generation_prompt: bool
    ) -> list[int]:
        spans = assistant_spans(self, conversation, text, generation_prompt=generation_prompt)
        if spans is None:  # the template rewrote the marked conversation: one render per turn
            spans = assistant_spans_by_prefixes(self, conversation, text)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(any(s < b and a < e for s, e in spans)) for a, b in encoded["offset_mapping"]]

    # -- per request kind ---------------------------------------------------------------

    def prompts(
        self,
        messages: Any,
        text: Any,
        tokens: Any,
        field: str,
        options: dict[str, Any] | None = None,
    ) -> list[Prepared]:
        """Generation prompts; conversations get the generation prompt appended (`options`:
        more variables for the template)."""
        if messages is not None:
            self._require_template(field)
            return each_named(
                field,
                messages,
                lambda conv: self.template(
                    plain_messages(conv), generation_prompt=True, options=options
                ),
            )
        if text is not None:
            return each_named(field, text, lambda t: Prepared(ids=self.encode(t), text=t))
        return [Prepared(ids=list(seq)) for seq in tokens]

    def checked_prompts(self, request: Any, field: str, *, max_new_tokens: int) -> list[Prepared]:
        """A generation request's prompts, checked against the vocabulary and length."""
        options = template_kwargs(getattr(request, "chat_template_kwargs", None))
        prompts = self.prompts(request.messages, request.text, request.tokens, field, options)
        self.check(prompts, field, max_new_tokens=max_new_tokens)
        return prompts

    def checked_sequences(self, request: Any, field: str) -> list[Prepared]:
        """A scoring request's sequences, checked against the vocabulary and length."""
        prepared = self.sequences(request, field)
        self.check(prepared, field)
        return prepared

    def sequences(self, request: Any, field: str) -> list[Prepared]:
        """Scoring sequences: whole conversations, texts, token lists or prompt/response splits."""
        if request.messages is not None:
            self._require_template(field)
            options = template_kwargs(getattr(request, "chat_template_kwargs", None))
            return each_named(
                field,
                request.messages,
                lambda conv: self._scored_conversation(plain_messages(conv), options),
            )
        if request.prompt_text is not None:
            prompts = each_named("prompt_text", request.prompt_text, self.encode)
            responses = each_named(
                "response_text", request.response_text, lambda r: self.encode(r, special=False)
            )
            return [
                self._split(prompt, response, prompt_text=p)
                for prompt, response, p in zip(prompts, responses, request.prompt_text, strict=True)
            ]
        if request.prompt_tokens is not None:
            return [
                self._split(list(p), list(r))
                for p, r in zip(request.prompt_tokens, request.response_tokens, strict=True)
            ]
        return self.prompts(None, request.text, request.tokens, field)

    def _scored_conversation(
        self, conversation: Conversation, options: dict[str, Any] | None = None
    ) -> Prepared:
        prepared = self.template(conversation, generation_prompt=False, options=options)
        if len(conversation) > 1 and conversation[-1]["role"] == "assistant":
            prompt = self.template(conversation[:-1], generation_prompt=True, options=options)
            if prepared.ids[: len(prompt.ids)] == prompt.ids:
                prepared.prompt_len = len(prompt.ids)
                prepared.prompt_text = prompt.text
                prepared.prompt_history = conversation[:-1]
        return prepared

    def _split(
        self, prompt: list[int], response: list[int], prompt_text: str | None = None
    ) -> Prepared:
        ids = prompt + response
        text = self.decode(ids) if prompt_text is not None else None
        return Prepared(ids=ids, prompt_len=len(prompt), text=text, prompt_text=prompt_text)

    # -- checks -------------------------------------------------------------------------

    def _require_template(self, field: str) -> None:
        if not self.has_chat_template:
            raise invalid(field, "this model's tokenizer has no chat template; send text or tokens")

    def check_vocabulary(self, ids: list[int], field: str) -> None:
        """422 naming `field` for the first id outside the vocabulary."""
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise invalid(
                field,
                f"token id {bad} at position {ids.index(bad)} is outside the "
                f"vocabulary (ids must be below {self.vocab_size})",
            )

    def check(self, prepared: list[Prepared], field: str, *, max_new_tokens: int = 0) -> None:
        """422 for empty sequences, ids outside the vocabulary and over-long sequences."""
        for i, item in enumerate(prepared):
            name = f"{field}[{i}]"
            if not item.ids:
                raise invalid(name, "the sequence has no tokens")
            self.check_vocabulary(item.ids, name)
            if len(item.ids) > self.max_model_len:
                raise invalid(
                    name,
                    f"{len(item.ids)} tokens exceed the model's maximum length "
                    f"of {self.max_model_len}",
                )
            if len(item.ids) + max_new_tokens > self.max_model_len:
                raise invalid(
                    "max_new_tokens",
                    f"{field}[{i}] has {len(item.ids)} tokens; with {max_new_tokens} new tokens "
                    f"it would exceed the model's maximum length of {self.max_model_len}",
                )


def check_num_items(num_items: int, limit: int, field: str) -> None:
    if num_items > limit:
        raise TooLarge(
            f"{field}: {num_items} sequences in one request exceed the limit of {limit} "
            "(RLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST)",
            param=field,
        )
