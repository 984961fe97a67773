"""The committed spec is exactly what the app exports."""

from __future__ import annotations

import json
from pathlib import Path

from app.cli import render_openapi

SPEC = Path(__file__).resolve().parents[1] / "openapi" / "openapi.json"
ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens"}
"""Routes that answer their own errors in Anthropic's shape (the auth layer's 401 and an
internal error stay in the service's)."""


def test_committed_spec_matches_the_app():
    assert SPEC.exists(), "run `rlserve export-openapi` to create openapi/openapi.json"
    assert SPEC.read_text() == render_openapi(), (
        "openapi/openapi.json is out of date: run `rlserve export-openapi`"
    )


def test_every_route_declares_the_error_body():
    spec = json.loads(SPEC.read_text())
    for path, methods in spec["paths"].items():
        for method, operation in methods.items():
            if path == "/live":  # (answers whenever the process does)
                continue
            # /health, /ready and /health_generate are public; /metrics may ask for a key
            # (RLSERVE_AUTH__METRICS_AUTH).
            public = path in ("/health", "/ready", "/health_generate")
            codes = ("422", "500", "503") if public else ("401", "422", "500", "503")
            for code in codes:
                schema = operation["responses"][code]["content"]["application/json"]["schema"]
                shape = "ErrorResponse"
                if path in ANTHROPIC and code not in ("401", "500"):  # (the route's own errors)
                    shape = "AnthropicError"
                assert schema == {"$ref": f"#/components/schemas/{shape}"}, (method, path, code)
            assert ("401" in operation["responses"]) is not public, (method, path)
            keyless = public or path == "/metrics"  # documented as its default: no key
            assert (operation.get("security") == []) is keyless, (method, path)


def test_the_spec_declares_bearer_auth():
    spec = json.loads(SPEC.read_text())
    assert spec["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert spec["security"] == [{"bearerAuth": []}]
    assert spec["paths"]["/health"]["get"]["security"] == []
