"""A path a request names is checked before any file call: a name over 255 bytes, a whole path
over 4095 or a NUL is a 422 (vLLM's routes: 400) naming the field (it was a 500 `File name too
long` on three of these routes), and a file call that fails on a path that passed is a 4xx
naming it too."""

from __future__ import annotations

import pytest

LONG = "/tmp/" + "x" * 300 + "/adapter"
ROUTES = [
    ("/v1/weights/load", {}, "path"),
    ("/v1/adapters", {"name": "a"}, "path"),
    ("/v1/datasets", {"name": "d"}, "path"),
    ("/areal_update_weights", {}, "model_path"),
    ("/update_weights_from_disk", {}, "model_path"),
    ("/update_weights", {}, "weight_dir"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
    ("/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
]


@pytest.mark.parametrize(("route", "body", "field"), ROUTES, ids=[r for r, _, _ in ROUTES])
@pytest.mark.parametrize(
    ("path", "why"),
    [
        (LONG, "each name in a path is at most 255 bytes; one here is 300"),
        ("/tmp/" + "é" * 200, "one here is 400"),  # bytes, not characters
        ("/tmp/" + "a/" * 2100, "4095"),
        ("/tmp/a\x00b", "no NUL"),
    ],
    ids=["long-name", "long-in-bytes", "long-path", "nul"],
)
async def test_a_path_no_file_call_can_take_is_refused_naming_its_field(
    client, route, body, field, path, why
):
    response = await client.post(route, json={**body, field: path})
    assert response.status_code in (400, 422), response.text  # (vLLM's routes answer 400)
    error = response.json()["error"]
    assert error["param"] == field and why in error["message"], error


async def test_a_file_call_that_fails_on_a_named_path_is_the_requests_failure(client, tmp_path):
    """Paths that pass the check but no file call can use: a loop of links, a file where a
    folder should be, a folder the server may not read."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    plain = tmp_path / "plain"
    plain.write_text("not a folder")
    for path in (loop / "x", plain / "x", loop):
        for route, body, field in ROUTES:
            response = await client.post(route, json={**body, field: str(path)})
            assert 400 <= response.status_code < 500, (route, path, response.text)
            assert response.json()["error"]["param"] == field, (route, response.text)
