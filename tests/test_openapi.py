"""The committed spec is exactly what the app exports."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import render_openapi

SPEC = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"


def test_committed_spec_matches_the_app():
    assert SPEC.exists(), "run `rlserve export-openapi` to create openapi/openapi.json"
    assert SPEC.read_text() == render_openapi(), (
        "openapi/openapi.json is out of date: run `rlserve export-openapi`"
    )


def test_every_route_declares_the_error_body():
    spec = json.loads(SPEC.read_text())
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            if path == "/health":
                continue
            for code in ("422", "500", "503"):
                schema = operation["responses"][code]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
