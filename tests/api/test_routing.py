"""The app's router holds its routes themselves: a request is matched once against a flat list,
the list the request-context middleware matches to find a route's policy."""

from __future__ import annotations

from pathlib import Path

from starlette.routing import Match, Route

from app.ops.context import RequestContextMiddleware
from tests.fake.backend import FakeBackend, fake_app


async def test_routes_are_matched_flat_and_as_the_middleware_matches_them(tmp_path: Path) -> None:
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    async with fake_app(tmp_path, *pair) as app:
        declared = app.state.routes
        served = app.router.routes
        # No included-router node (FastAPI >= 0.137 keeps one per include_router call, and
        # every request resolves through it); only FastAPI's own docs routes come before ours.
        assert all(isinstance(route, Route) for route in served)
        assert served[-len(declared) :] == declared
        for route in declared:
            for method in sorted(route.methods or ()):
                path = route.path.replace("{env_id}", "e1").replace("{rollout_id}", "r1")
                scope = {"type": "http", "path": path, "method": method, "root_path": ""}
                first = next(r for r in served if r.matches(scope)[0] == Match.FULL)
                assert first is route or first.path == route.path, (method, route.path)


async def test_the_middlewares_remembered_match_is_the_routers(tmp_path: Path) -> None:
    """The request-context middleware remembers its match per method and path: the answer is
    the first route whose pattern and method match, as a fresh scan finds it, again and again,
    for unknown paths and wrong methods too."""
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    async with fake_app(tmp_path, *pair) as app:
        routes = app.state.routes
        middleware = RequestContextMiddleware(app, metrics=app.state.metrics, routes=routes)
        asked = [("GET", "/nowhere"), ("DELETE", "/v1/logprobs"), ("GET", "/v1/envs/e1/step")]
        asked += [("GET", "/v1/envs/" + "e" * 300), ("POST", "/v1/envs/" + "e" * 300 + "/step")]
        asked += [(m, r.path.replace("{env_id}", "e1")) for r in routes for m in r.methods or ()]
        for _ in range(2):
            for method, path in asked:
                scope = {"type": "http", "method": method, "path": path, "root_path": ""}
                fresh = next((r for r in routes if r.matches(scope)[0] == Match.FULL), None)
                assert middleware._match(scope) is fresh, (method, path)
        assert middleware._match({"type": "http", "method": "GET", "path": "/nowhere"}) is None
