"""Request ids, metrics, auth, body limits, CORS and structured logs."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from app.batching import BackendCallError, QueueFullError
from app.common.failures import Failure, QuotaExceeded
from app.config import Settings
from app.errors import failure_error
from app.main import create_app
from app.ops.access import Access, policy_of
from app.ops.logs import JsonFormatter


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_every_response_carries_a_request_id(client):
    made = await client.get("/health")
    assert len(made.headers["x-request-id"]) == 32
    echoed = await client.post(
        "/v1/generate",
        json={"text": ["a"], "top_p": 2},
        headers={"X-Request-ID": "trainer-7:step-3"},
    )
    assert echoed.status_code == 422 and echoed.headers["x-request-id"] == "trainer-7:step-3"
    unsafe = await client.get("/health", headers={"X-Request-ID": "bad id\twith spaces"})
    assert unsafe.headers["x-request-id"] != "bad id\twith spaces"


async def test_metrics_count_requests_tokens_sessions_and_versions(client):
    before = samples((await client.get("/metrics")).text)
    body = {"tokens": [[1, 2, 3]], "max_tokens": 5, "ignore_eos": True, "n": 2}
    generated = (await client.post("/v1/generate", json=body)).json()
    scored = await client.post("/v1/logprobs", json={"tokens": [[1, 2, 3, 4]]})
    assert scored.status_code == 200
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = samples(response.text)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    new_tokens = sum(len(s["tokens"]["response"]) for s in generated["outputs"][0])
    assert delta("rlserve_tokens_generated_total", model="policy") == new_tokens == 10
    assert delta("rlserve_tokens_scored_total", model="policy") == 4
    ok = {"route": "/v1/generate", "method": "POST", "status": "200"}
    assert delta("rlserve_requests_total", **ok) == 1
    latency = {"route": "/v1/generate", "method": "POST"}
    assert delta("rlserve_request_duration_seconds_count", **latency) == 1
    assert delta("rlserve_batch_items_total", model="policy", kind="generate") == 2
    version = (await client.get("/v1/weights/version")).json()["policy_version"]
    assert after[("rlserve_policy_version", (("model", "policy"),))] == version
    live = (await client.get("/v1/envs")).json()["total"]
    assert after[("rlserve_env_sessions", ())] == live
    assert ("rlserve_queue_items", (("kind", "score"), ("model", "policy"))) in after


@pytest.fixture
async def guarded(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An app with keys, an admin key, a small body limit and CORS for one origin."""
    app: FastAPI = create_app(
        settings.replace(
            auth={"api_keys": ["user-key"], "admin_api_keys": ["admin-key"]},
            http={"max_body_bytes": 1000, "cors_origins": ["http://dashboard"]},
        ),
        load_models=False,
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rlserve") as c:
            yield c


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_keys_guard_every_route_but_health_ready_and_metrics(guarded):
    for headers in ({}, bearer("wrong"), {"Authorization": "Basic user-key"}):
        refused = await guarded.get("/v1/weights/version", headers=headers)
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["type"] == "authentication_error"
        assert "x-request-id" in refused.headers
    assert (await guarded.get("/v1/weights/version", headers=bearer("user-key"))).status_code == 200
    assert (
        await guarded.get("/v1/weights/version", headers=bearer("admin-key"))
    ).status_code == 200
    assert (await guarded.get("/live")).status_code == 200
    for path in ("/health", "/ready"):  # public, just not loaded
        assert (await guarded.get(path)).status_code == 503
    assert (await guarded.get("/metrics")).status_code == 200


async def test_options_without_a_key_tells_no_route_from_another(guarded):
    """Without a key, OPTIONS on a route and on no route get the same answer (a 405 and a 404
    told them apart); a browser's preflight is still answered (the CORS test below)."""
    answers = []
    for path in ("/v1/generate", "/v1/weights/load", "/v1/no-such-route"):
        response = await guarded.options(path)
        body = response.json()
        answers.append((response.status_code, body["error"]["message"], body["error"]["type"]))
    assert answers[0][0] == 401 and len(set(answers)) == 1, answers
    with_key = await guarded.options("/v1/generate", headers=bearer("user-key"))
    assert with_key.status_code == 405 and with_key.headers["allow"] == "POST"


async def test_weight_routes_need_the_admin_key(guarded):
    body = {"path": "/nowhere.safetensors"}
    user = await guarded.post("/v1/weights/load", json=body, headers=bearer("user-key"))
    assert user.status_code == 403 and user.json()["error"]["type"] == "permission_error"
    admin = await guarded.post("/v1/weights/load", json=body, headers=bearer("admin-key"))
    # past the keys, at the weights control: this app loaded no models (503, not 401/403)
    assert admin.status_code == 503 and "model is loading" in admin.json()["error"]["message"]


def declared(level: Access) -> list[tuple[str, str]]:
    """(method, path) of every route whose declared policy is `level`."""
    app = create_app(Settings(), load_models=False)
    return sorted(
        (method, route.path_format)  # the path as the spec writes it
        for route in app.state.routes
        if policy_of(route).access is level
        for method in getattr(route, "methods", ())
    )


ADMIN_ROUTES = declared(Access.ADMIN)


def test_the_weight_changing_routes_are_the_admin_routes():
    """The admin set is what the routes declare; it must cover every route that changes the
    served weights."""
    changing = {
        ("POST", "/v1/weights/load"),
        ("PUT", "/v1/weights"),
        ("POST", "/v1/weights/restore"),
    }
    assert changing <= set(ADMIN_ROUTES)
    assert ("GET", "/v1/weights/version") not in ADMIN_ROUTES


def test_the_spec_security_follows_the_declared_policy():
    app = create_app(Settings(), load_models=False)
    spec = app.openapi()
    public = {path for _, path in declared(Access.PUBLIC) + declared(Access.METRICS)}
    # /health_generate: SGLang's health route, public as SGLang's /health* are (its forward
    # is the readiness probe's, cached per RLSERVE_PROBE__INTERVAL_S).
    assert public == {"/health", "/live", "/ready", "/health_generate", "/metrics"}
    guarded = set(ADMIN_ROUTES) | set(declared(Access.OWNER))
    assert ("DELETE", "/v1/adapters/{name}") in guarded
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            assert (operation.get("security") == []) == (path in public), path
            assert ("403" in operation["responses"]) == ((method.upper(), path) in guarded), path
            unguarded = {"/health", "/live", "/ready", "/health_generate"}
            assert ("401" in operation["responses"]) == (path not in unguarded), path


async def test_an_unexpected_failure_is_one_error_body_with_the_request_id(settings):
    app = create_app(settings, load_models=False)

    async def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/v1/boom", boom)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://rlserve") as c:
            failed = await c.get("/v1/boom", headers={"X-Request-ID": "trace-500"})
            metrics = (await c.get("/metrics")).text
    assert failed.status_code == 500 and failed.headers["x-request-id"] == "trace-500"
    assert failed.json()["error"]["type"] == "internal_error"
    assert "a bug" not in failed.text  # the message names the class, not the details
    assert 'route="unmatched",status="500"' in metrics


SUFFIXES = ["%0A", "%0D", "%09", "%00", "%0D%0A", "%7F", "%0A%0A"]
VARIANTS = [
    *(lambda p, s=s: p + s for s in SUFFIXES),
    lambda p: p + "/",
    lambda p: "/" + p,
    lambda p: p.upper(),
    lambda p: p.replace("/weights", "//weights"),
    lambda p: p.replace("/weights", "/./weights"),
    lambda p: p + "%20",
]


@pytest.mark.parametrize(("method", "path"), sorted(ADMIN_ROUTES))
@pytest.mark.parametrize("variant", range(len(VARIANTS)))
async def test_no_path_variant_of_a_weight_route_passes_without_the_admin_key(
    guarded, method, path, variant
):
    """The admin check judges the route the router matches: a variant of a weight route's
    path either reaches no route or meets the same 403 (control characters are a 400)."""
    url = VARIANTS[variant](path)
    user = await guarded.request(
        method, url, json={"path": "/nowhere.safetensors"}, headers=bearer("user-key")
    )
    assert user.status_code in (400, 403, 404, 405, 307), (url, user.status_code, user.text)
    if user.status_code == 307:  # a redirect to the canonical path, which is guarded
        target = user.headers["location"]
        again = await guarded.request(
            method, target, json={"path": "/x"}, headers=bearer("user-key")
        )
        assert again.status_code in (403, 404, 405)
    if any(url.endswith(s) for s in SUFFIXES):
        assert user.status_code == 400 and user.json()["error"]["param"] == "path"


async def test_metrics_can_require_a_key(settings):
    app = create_app(
        settings.replace(auth={"api_keys": ["k"], "metrics_auth": True}), load_models=False
    )
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rlserve") as c:
            assert (await c.get("/metrics")).status_code == 401
            assert (await c.get("/metrics", headers=bearer("k"))).status_code == 200


async def test_bodies_over_the_limit_are_413(guarded, caplog):
    """Declared or chunked, a body over the limit is a 413 naming the setting: never a
    logged error, never a 5xx in /metrics (any client could trip 5xx alerting)."""
    headers = bearer("user-key")
    declared = await guarded.post("/v1/logprobs", json={"text": ["a" * 2000]}, headers=headers)
    assert declared.status_code == 413
    assert declared.json()["error"] == {
        "message": "body: the request body exceeds 1000 bytes (http.max_body_bytes, "
        "RLSERVE_HTTP__MAX_BODY_BYTES; weight and adapter uploads have their own limits)",
        "type": "request_too_large",
        "param": "body",
        "code": 413,
    }

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"text": ["'
        yield b"a" * 2000
        yield b'"]}'

    with caplog.at_level(logging.WARNING):
        streamed = await guarded.post(
            "/v1/logprobs",
            content=chunks(),
            headers={**headers, "content-type": "application/json"},
        )
    assert streamed.status_code == 413 and streamed.json() == declared.json()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    metrics = (await guarded.get("/metrics")).text
    counted = re.findall(r'rlserve_requests_total\{[^}]*route="/v1/logprobs"[^}]*\} ', metrics)
    assert counted and all('status="413"' in line for line in counted), counted
    # weight uploads have their own, larger limit
    upload = await guarded.put("/v1/weights", content=b"x" * 5000, headers=bearer("admin-key"))
    assert upload.status_code != 413


async def test_cors_is_off_unless_configured(client, guarded):
    preflight = {"Origin": "http://dashboard", "Access-Control-Request-Method": "POST"}
    assert (
        "access-control-allow-origin"
        not in (await client.options("/v1/generate", headers=preflight)).headers
    )
    allowed = await guarded.options("/v1/generate", headers=preflight)
    assert allowed.headers["access-control-allow-origin"] == "http://dashboard"
    other = await guarded.options("/v1/generate", headers={**preflight, "Origin": "http://evil"})
    assert "access-control-allow-origin" not in other.headers


async def test_access_log_is_structured(client, caplog):
    with caplog.at_level(logging.INFO, logger="rlserve.access"):
        response = await client.get("/v1/models", headers={"X-Request-ID": "abc-123"})
    (record,) = [r for r in caplog.records if r.name == "rlserve.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "abc-123" == response.headers["x-request-id"]
    assert (line["route"], line["status"], line["method"]) == ("/v1/models", 200, "GET")
    assert line["latency_ms"] >= 0 and line["level"] == "info"


async def test_probes_log_at_debug_unless_they_fail(client, guarded, caplog):
    """A load balancer polling /ready every second does not fill the INFO log; a probe route
    answering anything but a probe's answer is logged as any route is."""
    with caplog.at_level(logging.DEBUG, logger="rlserve.access"):
        assert (await client.get("/ready")).status_code == 200
        assert (await guarded.get("/ready")).status_code == 503  # no models: still loading
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/metrics")).status_code == 405
    levels = [(r.getMessage().split()[1], r.levelname) for r in caplog.records]
    assert levels == [
        ("/ready", "DEBUG"),
        ("/ready", "DEBUG"),
        ("/health", "DEBUG"),
        ("/metrics", "INFO"),
    ]


def test_every_domain_failure_has_one_status_and_it_is_declared():
    """Each failure kind maps to one status through the one table, and that status is in the
    spec of some route (so no route answers with a status the spec never mentions)."""
    spec = create_app(Settings(), load_models=False).openapi()
    declared_statuses = {
        int(code)
        for operations in spec["paths"].values()
        for operation in operations.values()
        for code in operation["responses"]
    }
    kinds = [Failure, *(k for k in Failure.__subclasses__() if k.__module__ == Failure.__module__)]
    assert len(kinds) >= 10
    for kind in kinds:
        error = failure_error(kind("what: went wrong", param="what"))
        assert error.param == "what" and error.message == "what: went wrong"
        assert error.status_code in declared_statuses, kind
    assert failure_error(QuotaExceeded("full")).headers == {"Retry-After": "5"}
    overloaded = failure_error(QueueFullError("3 requests already waiting"))
    assert overloaded.status_code == 503 and overloaded.headers == {"Retry-After": "1"}
    assert overloaded.status_code in declared_statuses
    assert failure_error(BackendCallError("RuntimeError: boom")).status_code in declared_statuses


async def test_an_undeclared_method_is_a_405_listing_every_method_of_the_path(client):
    """RFC 9110: a 405 carries Allow with the methods the path has, across the routes that
    share it (GET and POST of /v1/envs are two routes), in the one error shape."""
    for method, path, allowed in (
        ("PUT", "/v1/envs", "GET, POST"),
        ("PATCH", "/v1/envs/env-1", "DELETE, GET"),
        ("DELETE", "/v1/generate", "POST"),
        ("TRACE", "/health", "GET"),
        ("PUT", "/v1/adapters/someone/pause", "POST"),
        ("DELETE", "/v1/adapters/someone/resume", "POST"),
    ):
        response = await client.request(method, path)
        assert response.status_code == 405, (method, path)
        assert response.headers["allow"] == allowed, (method, path)
        assert response.json()["error"]["code"] == 405


async def test_a_mistyped_route_names_the_nearest_routes_and_a_method_the_path_takes(client):
    for method, path, nearest in (
        ("POST", "/v1/generation", "POST /v1/generate"),
        ("POST", "/v1/logprob", "POST /v1/logprobs"),
        ("GET", "/v1/modles", "GET /v1/models"),
    ):
        response = await client.request(method, path)
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert message.startswith(f"no route {method} {path}; the nearest: {nearest}"), message
    root = (await client.get("/")).json()["error"]["message"]
    assert root == "no route GET / (GET /docs lists every route)"
    wrong = await client.get("/v1/generate")
    assert wrong.status_code == 405
    assert wrong.json()["error"]["message"] == "GET is not a method of /v1/generate; it takes POST"
