"""The dialect routes coerce what the origin servers' models coerce (a boolean from 0, 1 or
"false", as vLLM's and SGLang's pydantic models in lax mode) and the spec says so: each body
below is answered with a 2xx exactly when the served OpenAPI spec's schema for it takes it
(checked with jsonschema, an independent validator). (Numbers coerce too, "5" for 5, as
AReaL's master_port needs; the spec does not say so.)"""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TOOL_TURN = {"messages": [{"role": "assistant", "content": "It is"}]}
CASES: list[tuple[str, dict[str, Any], bool]] = [
    # (route, body, whether it is taken)
    ("/continue_generation", {"torch_empty_cache": 0}, True),
    ("/continue_generation", {"torch_empty_cache": "false"}, True),
    ("/continue_generation", {"torch_empty_cache": 2}, False),
    ("/continue_generation", {"torch_empty_cache": "maybe"}, False),
    ("/tokenize", {"prompt": "hi", "return_token_strs": 1}, True),
    ("/tokenize", {"prompt": "hi", "return_token_strs": "yes"}, True),
    ("/tokenize", {"prompt": "hi", "return_token_strs": []}, False),
    # a cross-field rule meets the coerced values too (continue_final_message needs
    # add_generation_prompt: false)
    (
        "/tokenize",
        {**TOOL_TURN, "continue_final_message": 1, "add_generation_prompt": "yes"},
        False,
    ),
    ("/tokenize", {**TOOL_TURN, "continue_final_message": "on", "add_generation_prompt": 0}, True),
    ("/detokenize", {"tokens": [5, 6], "skip_special_tokens": 0}, True),
    ("/detokenize", {"tokens": [5, 6], "skip_special_tokens": "no"}, True),
    ("/detokenize", {"tokens": [5, 6], "skip_special_tokens": 0.5}, False),
    ("/v1/chat/completions", {**CHAT, "store": 0}, True),
    ("/v1/chat/completions", {**CHAT, "store": "on"}, True),
    ("/v1/chat/completions", {**CHAT, "store": {}}, False),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, True),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.0}, True),  # JSON's integer
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": 1}, True),
]


@pytest.fixture(scope="module")
def spec_validator(app):  # type: ignore[no-untyped-def]
    """A validator per route for its JSON body, from the spec the app serves."""
    spec = app.openapi()

    def validator(route: str) -> jsonschema.Draft202012Validator:
        body = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        # the body's schema as the root, with the components its references point into
        schema = {**body["schema"], "components": spec["components"]}
        return jsonschema.Draft202012Validator(schema)

    return validator


@pytest.mark.parametrize(
    ("route", "body", "taken"), CASES, ids=[f"{r}-{sorted(b.items())[-1]}" for r, b, _ in CASES]
)
async def test_a_dialect_takes_a_value_exactly_when_its_spec_does(
    client, spec_validator, route, body, taken
):
    response = await client.post(route, json=body)
    assert (200 <= response.status_code < 300) == taken, response.text
    assert spec_validator(route).is_valid(body) == taken, body


def _subclasses(cls: type) -> set[type]:
    found = set(cls.__subclasses__())
    return found.union(*(_subclasses(sub) for sub in found))


def test_every_dialect_models_schema_says_its_booleans_coerce(app):  # type: ignore[no-untyped-def]
    """A dialect model with a schema hook of its own (`json_schema_extra`) keeps the stated
    coercions (`dialect_schema`): no property of any of them is a bare boolean."""
    from app.common.dialect_models import (
        DialectModel,
    )

    def bare(node: dict[str, Any]) -> bool:
        if "anyOf" in node:
            stated = {"enum": [0, 1]} in node["anyOf"]
            return not stated and any(bare(member) for member in node["anyOf"])
        if isinstance(node.get("items"), dict):
            return bare(node["items"])
        return node.get("type") == "boolean"

    models = _subclasses(DialectModel)
    assert len(models) > 30
    for model in models:
        schema = model.model_json_schema(mode="validation")
        properties = schema.get("properties", {})
        assert not [name for name, node in properties.items() if bare(node)], model.__name__
