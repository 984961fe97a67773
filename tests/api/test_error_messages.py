"""The likeliest mistakes get errors that say what to fix: where malformed JSON breaks, a body
sent without its JSON content type, OpenAI-style flat messages on rlserve's routes, a field
the route does not take (with the ones it does)."""

from __future__ import annotations

import json

import pytest
from rlserve_client import UnprocessableEntityError

JSON = {"content-type": "application/json"}


async def error_of(response) -> dict:  # type: ignore[no-untyped-def]
    assert response.status_code in (400, 422), response.text
    return response.json()["error"]


async def test_malformed_json_says_what_breaks_and_where(client):
    body = '{"tokens": [[1, 2]],\n  "max_new_tokens": }'
    error = await error_of(await client.post("/v1/generate", content=body, headers=JSON))
    at = body.index("}", body.index("max_new_tokens"))  # where a value was expected
    column = at - body.rindex("\n", 0, at)
    assert error["message"] == (
        f"the body is not valid JSON: Expecting value at line 2, column {column}"
    )
    assert error["param"] is None
    json.loads(body[:at] + "1" + body[at:])  # the place named is the place to fix


@pytest.mark.parametrize(
    ("headers", "said"),
    [({}, "none"), ({"content-type": "text/plain"}, "'text/plain'")],
)
async def test_a_body_without_its_json_content_type_says_so(client, headers, said):
    body = json.dumps({"tokens": [[1, 2]]})
    for route in ("/v1/generate", "/v1/chat/completions"):
        error = await error_of(await client.post(route, content=body, headers=headers))
        assert "content-type: application/json" in error["message"]
        assert error["message"].endswith(f"(got {said})")
    # the same body with the header is fine
    assert (await client.post("/v1/generate", content=body, headers=JSON)).status_code == 200


async def test_flat_messages_are_told_the_shape_of_conversations(client):
    flat = {"messages": [{"role": "user", "content": "Hi"}], "max_new_tokens": 2}
    error = await error_of(await client.post("/v1/generate", json=flat))
    assert error["param"] == "messages[0]"
    assert "messages holds conversations" in error["message"]
    shown = error["message"].split(": ", 2)[-1]
    fixed = {**flat, "messages": json.loads(shown)["messages"]}  # the shape shown is valid
    fixed["messages"][0][0]["content"] = "Hi"
    assert (await client.post("/v1/generate", json=fixed)).status_code == 200


async def test_an_unknown_field_lists_the_fields_the_route_takes(client):
    error = await error_of(await client.post("/v1/generate", json={"prompt": "Hi"}))
    assert error["param"] == "prompt"
    taken = error["message"].split("it takes ", 1)[1].rstrip(")").split(", ")
    assert {"messages", "text", "tokens", "max_new_tokens"} <= set(taken)
    assert "prompt" not in taken


@pytest.mark.parametrize(
    ("typo", "meant"),
    [("max_token", "max_tokens"), ("temprature", "temperature"), ("mesages", "messages")],
)
async def test_a_misspelt_field_is_told_the_nearest(client, typo, meant):
    body = {"text": ["Hi"], typo: 1} if typo != "mesages" else {typo: [[]]}
    error = await error_of(await client.post("/v1/generate", json=body))
    assert error["param"] == typo and f"did you mean '{meant}'?" in error["message"]


async def test_no_body_is_told_what_body_the_route_takes(client):
    error = await error_of(await client.post("/v1/logprobs"))
    assert error["param"] == "body"
    assert error["message"].startswith("body: the request has no body; send a JSON object")
    assert "tokens" in error["message"] and "Field required" not in error["message"]


async def test_the_clients_errors_say_the_message_once(client):
    from rlserve_client import AsyncClient

    transport = client._transport
    async with AsyncClient(base_url="http://rlserve", transport=transport) as ours:
        with pytest.raises(UnprocessableEntityError) as caught:
            await ours.generate(text=["Hi"], max_new_tokens=2, temperature=-1)
    error = caught.value
    assert error.status_code == 422 and error.param == "temperature"
    assert str(error) == error.message and not str(error).startswith("422")
    assert "status_code=422" in repr(error)
