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
    # integers take false and true as 0 and 1, as the origins' do (where the bounds allow)
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, True),
    ("/v1/completions", {"prompt": "hi", "max_tokens": False}, False),  # (at least 1)
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "prompt_logprobs": False}, True),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": False}, True),
    ("/v1/chat/completions", {**CHAT, "n": True}, True),
    # token ids never: a boolean is no token (the origins would read true as token 1)
    ("/detokenize", {"tokens": [True, False]}, False),
    ("/v1/detokenize", {"tokens": [[5, True]]}, False),
    ("/v1/completions", {"prompt": [True, 5], "max_tokens": 2}, False),
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}, True),
    ("/inference/v1/generate", {"token_ids": [5, True], "sampling_params": {}}, False),
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
    coercions (`dialect_schema`): no property of any of them is a bare boolean (a boolean is
    stated beside 0 and 1, or is what an integer takes), and none a bare scalar integer."""
    from app.common.dialect_models import (
        DialectModel,
    )

    def bare(node: dict[str, Any]) -> bool:
        if "anyOf" in node:
            members = node["anyOf"]
            stated = {"enum": [0, 1]} in members or any(m.get("type") == "integer" for m in members)
            return not stated and any(bare(member) for member in members)
        if isinstance(node.get("items"), dict):
            return node["items"].get("type") == "boolean"
        if node.get("type") == "integer":  # a scalar integer: takes false and true, stated
            return node.get("minimum", 0) <= 1 and node.get("maximum", 1) >= 0
        return node.get("type") == "boolean"

    models = _subclasses(DialectModel)
    assert len(models) > 30
    for model in models:
        schema = model.model_json_schema(mode="validation")
        properties = schema.get("properties", {})
        assert not [name for name, node in properties.items() if bare(node)], model.__name__


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/v1/generate", {"text": ["hi"], "max_tokens": True}, "max_tokens"),
        ("/v1/generate", {"tokens": [[5, True]], "max_tokens": 2}, "tokens"),
        ("/v1/generate", {"text": ["hi"], "max_tokens": 2, "logprobs": 1}, "logprobs"),
        ("/v1/logprobs", {"tokens": [[5, 6]], "top_logprobs": False}, "top_logprobs"),
        ("/v1/kl", {"tokens": [[5, 6]], "coeff": True}, "coeff"),
    ],
)
async def test_rlserve_own_routes_take_no_boolean_for_a_number(client, route, body, field):
    """rlserve's own routes are no other server's dialect: their models are strict (a
    boolean is no number, as their spec says), and the refusal names the field."""
    refused = await client.post(route, json=body)
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["param"].startswith(field), refused.text


def test_every_body_model_of_rlserve_own_routes_is_strict_all_the_way_down(app):  # type: ignore[no-untyped-def]
    """Every JSON body of a route that is no dialect's: a strict model, its nested models too
    (a lax one inside would take a boolean for a number unseen)."""
    from fastapi.routing import APIRoute
    from pydantic import BaseModel

    from app.common.dialect_models import DialectModel

    def models(annotation: Any) -> list[type[BaseModel]]:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return [annotation]
        return [m for arg in getattr(annotation, "__args__", ()) for m in models(arg)]

    def lax(model: type[BaseModel], seen: set[type]) -> list[str]:
        if model in seen:
            return []
        seen.add(model)
        found = [] if model.model_config.get("strict") else [model.__name__]
        for info in model.model_fields.values():
            for inner in models(info.annotation):
                found += lax(inner, seen)
        return found

    checked = 0
    for route in app.routes:
        body = getattr(route, "body_field", None) if isinstance(route, APIRoute) else None
        if body is None or route.endpoint.__module__.startswith("app.dialects."):
            continue  # (another server's route: as lax as its origin)
        for model in models(body.field_info.annotation):
            if issubclass(model, DialectModel):
                continue
            checked += 1
            assert not lax(model, set()), (route.path, lax(model, set()))
    assert checked > 20
