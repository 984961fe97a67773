"""The wire models of other servers' dialects (vLLM's, SGLang's, OpenAI's): as lenient as their
origins (pydantic's lax mode, booleans from 0, 1 and "yes"), their schemas saying so, and the
fields they accept and ignore logged."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, ClassVar

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from app.common.inputs import InputPreparer, Prepared
from app.common.protocol import TokenId, WireModel, with_nulls

_log = logging.getLogger("rlserve.requests")


TokenInput = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)
"""The pooling routes' `input` (vLLM's and SGLang's): a string, strings, one sequence of token
ids, or several."""


BOOL_STRINGS = (
    r"^(0|1|[Tt]([Rr][Uu][Ee])?|[Ff]([Aa][Ll][Ss][Ee])?|[Yy]([Ee][Ss])?|[Nn][Oo]?"
    r"|[Oo]([Nn]|[Ff][Ff]))$"
)
"""The strings pydantic's lax mode (vLLM's and SGLang's request models) reads as a boolean."""


TRUE_STRINGS = r"^(1|[Tt]([Rr][Uu][Ee])?|[Yy]([Ee][Ss])?|[Oo][Nn])$"
FALSE_STRINGS = r"^(0|[Ff]([Aa][Ll][Ss][Ee])?|[Nn][Oo]?|[Oo][Ff][Ff])$"
RULES = ("not", "allOf", "anyOf", "oneOf", "if", "then", "else")
"""The keywords of a model's cross-field rules (`never_together`, NOT_CONTINUE_AND_OPEN)."""


def _coercions_stated(schema: dict[str, Any]) -> None:
    """A dialect model's JSON Schema, saying what its booleans take besides true and false:
    0 and 1, and the strings of BOOL_STRINGS, as the origin servers' models take them; in its
    cross-field rules too (a rule's `{"const": true}` meets 1 and "yes" as the validator
    does). And what its integers take: false and true as 0 and 1 (where the bounds allow),
    as the origins do, but for token ids (`TokenId`: never a boolean)."""
    for name, node in schema.get("properties", {}).items():
        schema["properties"][name] = _lax_integers(_lax_booleans(node))
    for key in RULES:
        if key in schema:
            schema[key] = _lax_rule(schema[key])


def _lax_rule(node: Any) -> Any:
    """A rule's boolean constants as the lax values equal to them."""
    if isinstance(node, list):
        return [_lax_rule(member) for member in node]
    if not isinstance(node, dict):
        return node
    if set(node) == {"const"} and isinstance(node["const"], bool):
        value = node["const"]
        strings = TRUE_STRINGS if value else FALSE_STRINGS
        return {
            "anyOf": [
                {"const": value},
                {"const": int(value)},
                {"type": "string", "pattern": strings},
            ]
        }
    return {
        key: _lax_rule(value) if key in (*RULES, "properties") or isinstance(value, dict) else value
        for key, value in node.items()
    }


def dialect_schema(
    hook: Callable[[dict[str, Any]], None] | dict[str, Any],
) -> Callable[[dict[str, Any]], None]:
    """A dialect model's own JSON-schema hook (or keys to add), with the coercions stated
    too (a subclass's `json_schema_extra` takes the place of DialectModel's)."""

    def both(schema: dict[str, Any]) -> None:
        if callable(hook):
            hook(schema)
        else:
            schema.update(hook)
        _coercions_stated(schema)

    return both


def _lax_integers(node: dict[str, Any]) -> dict[str, Any]:
    """A property's integer (alone or among its `anyOf`; an array's items are token ids and
    the like, left as they are) with the booleans its bounds admit."""
    if "anyOf" in node:
        members = [_lax_integers(m) for m in node["anyOf"]]
        return {**node, "anyOf": [m for member in members for m in member.get("anyOf", [member])]}
    if node.get("type") != "integer":
        return node
    low = node.get("minimum", node.get("exclusiveMinimum", -math.inf) + 1)
    high = node.get("maximum", node.get("exclusiveMaximum", math.inf) - 1)
    allowed = node.get("enum", [node["const"]] if "const" in node else None)
    taken = [
        value
        for value in (False, True)
        if low <= int(value) <= high and (allowed is None or int(value) in allowed)
    ]
    if not taken:
        return node
    inner = {k: v for k, v in node.items() if k not in ("title", "description", "default")}
    outer = {k: v for k, v in node.items() if k in ("title", "description", "default")}
    booleans = {"type": "boolean"} if len(taken) == 2 else {"const": taken[0]}
    return {**outer, "anyOf": [inner, booleans]}


def _lax_booleans(node: dict[str, Any]) -> dict[str, Any]:
    if "anyOf" in node:
        return {**node, "anyOf": [_lax_booleans(member) for member in node["anyOf"]]}
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        return {**node, "items": _lax_booleans(node["items"])}
    if node.get("type") != "boolean":
        return node
    rest = {k: v for k, v in node.items() if k not in ("type", "const")}
    if "const" in node:  # Literal[False]: 0 too (0 == False), no string
        return {**rest, "enum": [node["const"], int(node["const"])]}
    return {
        **rest,
        "anyOf": [
            {"type": "boolean"},
            {"enum": [0, 1]},
            {"type": "string", "pattern": BOOL_STRINGS},
        ],
    }


class DialectModel(WireModel):
    """A body of another server's dialect (vLLM's, SGLang's, OpenAI's): values coerce as that
    server's own models do where it serves its clients (pydantic's lax mode: 0 and "false"
    for false, 2.0 for 2, "5" for 5: AReaL sends master_port as a string), and the schema
    says so for booleans (`_coercions_stated`)."""

    model_config = ConfigDict(strict=False, json_schema_extra=_coercions_stated)


class NullsKept(DialectModel):
    """A dialect's answer whose `kept_null` fields are written as null where the route leaves
    out None fields: the keys its origin always sends (vLLM's `stop_reason` at an
    end-of-sequence finish, a message's `content` with no text), which its clients read."""

    kept_null: ClassVar[tuple[str, ...]] = ()

    # (No return annotation: with one, pydantic would publish it as the model's schema.)
    @model_serializer(mode="wrap")
    def _keep_null(self, handler: SerializerFunctionWrapHandler):  # type: ignore[no-untyped-def]
        return with_nulls(handler(self), self.kept_null)


def warn_ignored(route: str, fields: Iterable[str]) -> None:
    """Log the fields a request gave that change nothing here: the unknown fields of the
    models that accept them (the dialects' and OpenAI's, as vLLM ignores them with a warning),
    and known fields without effect."""
    names = sorted(fields)
    if names:
        _log.warning("%s: accepted and ignored (no effect on this server): %s", route, names)


def token_rows(given: Any) -> list[str | list[int]]:
    """A `TokenInput` as the sequences it is: one string or one list of ids is one sequence."""
    return [given] if isinstance(given, str) or isinstance(given[0], int) else list(given)


def token_items(preparer: InputPreparer, given: Any, *, special: bool = True) -> list[Prepared]:
    """A `TokenInput`'s sequences, strings tokenized with the model's special tokens unless
    `special` is false."""
    return [
        Prepared(ids=preparer.encode(row, special=special) if isinstance(row, str) else row)
        for row in token_rows(given)
    ]


class TokenUsage(DialectModel):
    """The pooling routes' `usage`: the tokens read (no completion)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0

    @classmethod
    def of(cls, items: Sequence[Prepared]) -> TokenUsage:
        tokens = sum(len(item.ids) for item in items)
        return cls(prompt_tokens=tokens, total_tokens=tokens)
