"""Wire models shared by every route: the base class, chat messages and inputs (the
TorchRL-style sample containers are `app.common.containers`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal, Self

from fastapi import Response
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    WithJsonSchema,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.engine import types as engine_types

ModelName = Literal["policy", "reference"]
ServedName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        description="'policy', 'reference', an alias of either (--served-model-name), or the "
        "name of a served LoRA adapter (`POST /v1/adapters`).",
    ),
]
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]*$"
AdapterName = Annotated[
    str,
    Field(
        min_length=1,
        max_length=128,
        pattern=ADAPTER_NAME_PATTERN,
        description="The adapter's name: what requests put in `model` to use it.",
    ),
]
NAME_MAX = 255
"""Bytes in one component of a path (a file or folder name) on Linux's filesystems."""
PATH_MAX = 4096
"""Bytes in a whole path, its terminating NUL included."""


def _server_path(value: str) -> str:
    """A path the server can hand to a file call: no NUL byte, no name over NAME_MAX bytes,
    the whole under PATH_MAX (else the file call fails with an OSError, not the client's
    field)."""
    if "\x00" in value:
        raise PydanticCustomError("server_path", "a path holds no NUL character")
    encoded = os.fsencode(value)
    if len(encoded) >= PATH_MAX:
        raise PydanticCustomError(
            "server_path", "a path is at most {most} bytes", {"most": PATH_MAX - 1}
        )
    longest = max(len(part) for part in encoded.split(b"/"))
    if longest > NAME_MAX:
        raise PydanticCustomError(
            "server_path",
            "each name in a path is at most {most} bytes; one here is {longest}",
            {"most": NAME_MAX, "longest": longest},
        )
    return value


ServerPath = Annotated[
    str, Field(min_length=1, max_length=PATH_MAX - 1), AfterValidator(_server_path)
]
"""A file or folder on the server a request names: checked before any file call (names of at
most NAME_MAX bytes; see `app.common.files` for the file calls' own errors)."""


def _not_a_boolean(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("a token id is an integer, not a boolean")
    return value


TokenId = Annotated[int, Field(ge=0, le=(1 << 31) - 1), BeforeValidator(_not_a_boolean)]
"""A token id: an integer (in a dialect's body 2.0 too, as the origin's lax models and JSON
Schema's integer take it), never a boolean, on every route: the origins' lax models would
read true as token 1, and what a client sends as tokens is what the model sees."""
TokenList = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]


def one_of(
    *choices: tuple[str, ...], optional: bool = False, only_with: dict[str, str] | None = None
) -> Callable[[dict[str, Any]], None]:
    """A model's JSON-schema hook (`json_schema_extra`) stating what its validator checks:
    exactly one choice (at most one with `optional`) has all its fields given (non-null),
    and every field of the other choices is absent or null. So the spec promises no more
    than validation allows. `only_with`: a field given only in the choice holding another
    (chat_template_kwargs with messages)."""
    fields = [name for choice in choices for name in choice]

    def given(choice: tuple[str, ...]) -> dict[str, Any]:
        properties: dict[str, Any] = {n: {"not": {"type": "null"}} for n in choice}
        properties |= {n: {"type": "null"} for n in fields if n not in choice}
        for name, needs in (only_with or {}).items():
            if needs not in choice:
                properties[name] = {"type": "null"}
        return {"required": list(choice), "properties": properties}

    def hook(schema: dict[str, Any]) -> None:
        alternatives = [given(choice) for choice in choices]
        if optional:
            alternatives.append({"properties": {n: {"type": "null"} for n in fields}})
        schema["oneOf"] = alternatives

    return hook


def never_together(**conditions: dict[str, Any]) -> dict[str, Any]:
    """A schema refusing a body where every named field is given and meets its condition
    (a cross-field rule the validator checks, stated in the spec)."""
    return {"not": {"required": list(conditions), "properties": conditions}}


STREAMED: dict[str, Any] = {"const": True}
POSITIVE: dict[str, Any] = {"type": "integer", "exclusiveMinimum": 0}

NOT_CONTINUE_AND_OPEN: dict[str, Any] = {
    "not": {
        "required": ["continue_final_message"],
        "properties": {
            "continue_final_message": {"const": True},
            "add_generation_prompt": {"const": True},
        },
    }
}
"""vLLM's chat rule in a schema: continue_final_message needs add_generation_prompt: false
(which defaults to true)."""


def stop_list(stop: str | list[str] | None) -> list[str]:
    """A `stop` field (one string, several, or none) as a list."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def top_k_or_none(top_k: int | None) -> int | None:
    """vLLM's `top_k`, where 0 and -1 mean every token: None (no filter) for those."""
    return top_k if top_k is not None and top_k > 0 else None


def field_error(field: str, message: str) -> PydanticCustomError:
    """A validation error that names `field` (the error handler reports it as `param`)."""
    return PydanticCustomError("invalid_field", "{field}: " + message, {"field": field})


TOKEN_ID_KEYS: dict[str, Any] = {"propertyNames": {"pattern": "^[0-9]+$"}}
"""A logit_bias map's json_schema_extra: its keys are token ids written in digits."""

ONLY_UNSET: dict[str, Any] = {"type": "null"}
"""A field's json_schema_extra where a dialect declares a field rlserve refuses unless unset:
the spec says null (ANDed with the field's own type), as the server answers."""


class WireModel(BaseModel):
    """Base of every request and response body. Unknown request fields are rejected, so are
    NaN and infinities (a number is a finite number, in and out) and strings that are not
    valid Unicode (lone surrogates: nothing could store or print them). Values are taken as
    the schema types them, never coerced (pydantic's strict mode: 0 is not false, "5" is not
    5, 2.0 is not 2; an integer is a number); the other servers' dialects coerce as those
    servers do (DialectModel)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: object) -> object:
        if isinstance(data, dict):
            where = _lone_surrogate(data, "")
            if where is not None:
                raise field_error(where or "body", "contains a lone surrogate (not valid Unicode)")
        return data


def with_nulls(data: Any, names: tuple[str, ...]) -> Any:
    """A model's dump with the fields `names` as null where the dump left None ones out."""
    if isinstance(data, dict):
        for name in names:
            data.setdefault(name, None)
    return data


class KeepsNull(WireModel):
    """A wire model whose `kept_null` fields are written as null rather than left out when
    the route leaves out None fields (a null reward says "no reward": absent, it would read
    as a missing field)."""

    kept_null: ClassVar[tuple[str, ...]] = ()

    # (No return annotation: with one, pydantic would publish it as the model's schema.)
    @model_serializer(mode="wrap")
    def _keep_null(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        return with_nulls(handler(self), self.kept_null)


def _lone_surrogate(value: object, path: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, if any."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _lone_surrogate(key, inner) is not None:
                return inner
            found = _lone_surrogate(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list) and not set(map(type, value)) <= _SCALARS:  # token ids: skip
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


_SCALARS = {int, float, bool, type(None)}


def _not_too_cold(value: float | None) -> float | None:
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {value}")
    return value


# Sampling parameters with the bounds inside which the model call stays finite (logits divided
# by 1e-320 or scaled by a penalty of 1e-300 overflow to inf, and a top_k past int64 fails).
MIN_TEMPERATURE = 0.01
Temperature = Annotated[
    float | None,
    Field(default=None, ge=0, le=1e4, description="Default 1.0; 0 is greedy."),
    AfterValidator(_not_too_cold),
    # The spec says the rule too: 0, or from MIN_TEMPERATURE up.
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "enum": [0]},
                {"type": "number", "minimum": MIN_TEMPERATURE, "maximum": 1e4},
                {"type": "null"},
            ],
            "description": f"Default 1.0; 0 is greedy; else at least {MIN_TEMPERATURE}.",
        }
    ),
]
TopP = Annotated[float, Field(default=1.0, ge=0, le=1)]
TopK = Annotated[int | None, Field(default=None, gt=0, le=1 << 30)]
RoutedExperts = list[list[list[Annotated[int, Field(ge=0)]]]]
"""A sequence's routed experts: per token, per hidden layer, the top-k expert ids."""
RepetitionPenalty = Annotated[float, Field(default=1.0, ge=0.01, le=100)]
MAX_SEED = (1 << 63) - 1024
"""Seeds fit in 63 bits; the bound is one a double holds exactly (FastAPI's schema models keep
bounds as floats), so the spec states the very bound the server checks."""
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
Version = Annotated[int, Field(ge=1, le=engine_types.MAX_VERSION)]
"""A weight version a trainer names: 1 to 2^53 - 1, what a JSON number holds exactly."""
VersionText = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,15}$")]
"""A dialect's weight version as the trainer sends it (a string there): a whole number, at
most 2^53 - 1 (`app.dialects.common.version_number`). One not above the served version (GET
/v1/weights/version) is a restarted trainer's count: served as the next version, in a new
lineage (`app.dialects.common.publish`)."""


Role = Literal["system", "developer", "user", "assistant", "tool"]
"""The roles chat templates know (developer: OpenAI's name for system instructions, given to a
template that does not name it as system)."""


class Message(WireModel):
    role: Role
    content: str


Conversation = Annotated[list[Message], Field(min_length=1)]


class CalledFunction(WireModel):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    arguments: str = Field(
        description="The JSON text of the arguments, as the model wrote it (the chat route's "
        "`tool_calls`): a template that writes them as given renders the sampled tokens."
    )


class CalledTool(WireModel):
    id: Annotated[str, Field(min_length=1, max_length=256)]
    type: Literal["function"] = "function"
    function: CalledFunction


Refusal = Annotated[
    str | None,
    Field(
        description="An assistant reply's refusal, as OpenAI's replies carry it (the OpenAI "
        "SDK's message, sent back as it came): the turn's content when it has none."
    ),
]
Annotations = Annotated[
    list[dict[str, Any]] | None,
    Field(
        max_length=1024,
        description="An assistant reply's annotations (URL citations), as OpenAI's replies "
        "carry them: taken, not rendered.",
    ),
]
NoValue = Annotated[
    None,
    Field(
        description="Part of OpenAI's assistant replies that rlserve never gives (audio; the "
        "deprecated function_call: send tool_calls): null only."
    ),
]


class InputMessage(Message):
    """A message of a conversation to template, in the chat route's shape: an assistant turn
    may carry its reasoning and its tool calls, a tool message the call it answers, so an
    agent's episode is scored and sampled from exactly as the chat route rendered it."""

    reasoning_content: str | None = Field(
        default=None,
        description="An assistant turn's reasoning, rendered where its chat template renders "
        "it (Qwen3's <think> block), as on the chat route.",
    )
    reasoning: str | None = Field(
        default=None, description="vLLM's name for reasoning_content (either may be sent)."
    )
    tool_calls: Annotated[list[CalledTool], Field(max_length=1024)] | None = Field(
        default=None, description="An assistant turn's tool calls, as the chat route gives them."
    )
    tool_call_id: str | None = Field(
        default=None, max_length=256, description="A tool message's call, as on the chat route."
    )
    name: str | None = Field(default=None, max_length=256, description="As on the chat route.")
    refusal: Refusal = None
    annotations: Annotations = None
    audio: NoValue = None
    function_call: NoValue = None


InputConversation = Annotated[list[InputMessage], Field(min_length=1)]


Penalty = Annotated[float, Field(ge=-2, le=2)]
"""OpenAI's presence and frequency penalties."""
LogitBias = Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)]
"""Token id, in digits (as JSON keys are), to the bias added to its logit."""
BadWords = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=128)]


class ShapingFields(WireModel):
    """The sampling parameters that shape the distribution beyond temperature, top-k and
    top-p, under vLLM's names and meanings (its dialects and OpenAI's routes take them too)."""

    min_p: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Drop tokens less likely than min_p times the most likely one.",
    )
    min_tokens: int = Field(
        default=0,
        ge=0,
        description="End-of-sequence, stop_token_ids and stop strings take effect only from "
        "this many generated tokens on.",
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = Field(
        default=None, description="Stop after any of these tokens (stop_reason names it)."
    )
    presence_penalty: Penalty = Field(
        default=0.0, description="Minus this, once a token was generated."
    )
    frequency_penalty: Penalty = Field(
        default=0.0, description="Minus this times how often a token was generated."
    )
    logit_bias: LogitBias | None = Field(
        default=None,
        description="Token id (in digits) -> bias added to its logit, before the penalties.",
        json_schema_extra=TOKEN_ID_KEYS,
    )
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 18)] | None = (
        Field(default=None, description="Sample only these tokens.")
    )
    bad_words: BadWords | None = Field(
        default=None, description="Words never generated (as vLLM's bad_words)."
    )


TEMPLATED = {"chat_template_kwargs": "messages"}
"""The fields given only with a conversation to template."""


class InputFields(WireModel):
    """Exactly one of `messages`, `text` or `tokens`; each a list with one entry per sequence."""

    model_config = ConfigDict(
        json_schema_extra=one_of(("messages",), ("text",), ("tokens",), only_with=TEMPLATED)
    )

    messages: Annotated[list[InputConversation], Field(min_length=1)] | None = Field(
        default=None, description="Chat conversations, templated with the model's chat template."
    )
    text: Annotated[list[NonEmptyText], Field(min_length=1)] | None = Field(
        default=None, description="Raw strings, tokenized with the model's tokenizer."
    )
    tokens: Annotated[list[TokenList], Field(min_length=1)] | None = Field(
        default=None, description="Token ids, used exactly as given."
    )
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=64)] | None = Field(
        default=None,
        description="With messages: more variables for the chat template, as on the chat route "
        "(Qwen3's enable_thinking).",
    )

    @model_validator(mode="after")
    def _template_kwargs_with_messages(self) -> Self:
        if self.chat_template_kwargs is not None and self.messages is None:
            raise field_error("chat_template_kwargs", "only with messages (a chat template)")
        return self

    def given_inputs(self) -> list[str]:
        return [name for name in _INPUT_FIELDS if getattr(self, name, None) is not None]


_INPUT_FIELDS = ("messages", "text", "tokens", "prompt_text", "prompt_tokens")
_PAIRS = {"prompt_text": "response_text", "prompt_tokens": "response_tokens"}


def check_exactly_one(model: InputFields, allowed: tuple[str, ...]) -> None:
    given = model.given_inputs()
    if len(given) != 1:
        names = ", ".join(allowed)
        detail = "none was given" if not given else f"got {', '.join(given)}"
        raise field_error(given[1] if given else "input", f"give exactly one of {names}; {detail}")


class SplitInputFields(InputFields):
    """Scoring inputs: also a prompt/response split, as text or as tokens."""

    model_config = ConfigDict(
        json_schema_extra=one_of(
            ("messages",),
            ("text",),
            ("tokens",),
            ("prompt_text", "response_text"),
            ("prompt_tokens", "response_tokens"),
            only_with=TEMPLATED,
        )
    )

    prompt_text: Annotated[list[str], Field(min_length=1)] | None = None
    response_text: Annotated[list[str], Field(min_length=1)] | None = None
    prompt_tokens: Annotated[list[list[TokenId]], Field(min_length=1)] | None = None
    response_tokens: Annotated[list[list[TokenId]], Field(min_length=1)] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> SplitInputFields:
        for prompt_field, response_field in _PAIRS.items():
            prompts, responses = getattr(self, prompt_field), getattr(self, response_field)
            if prompts is None and responses is not None:
                raise field_error(response_field, f"requires {prompt_field}")
            if prompts is not None and responses is None:
                raise field_error(response_field, f"is required with {prompt_field}")
            if prompts is not None and len(prompts) != len(responses):
                raise field_error(
                    response_field,
                    f"has {len(responses)} entries but {prompt_field} has {len(prompts)}",
                )
        check_exactly_one(self, _INPUT_FIELDS)
        return self

    def num_items(self) -> int:
        return len(getattr(self, self.given_inputs()[0]))


def json_response(model: BaseModel, *, status_code: int = 200) -> Response:
    """Serialise a response model once (skipping FastAPI's re-validation of large bodies)."""
    return Response(
        model.model_dump_json(exclude_none=True),
        status_code=status_code,
        media_type="application/json",
    )
