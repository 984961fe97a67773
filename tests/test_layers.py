"""The layers of `app/`, read from the import graph (`tests/test_import_graph.py`): the engine,
the weights and the shared modules below every service; the dialects above the services;
the request-time composition root (`app.deps`) imported by route modules only; the app
itself (`app.main`) by its entry points only. Each rule holds today with no exception, so
each fails on the first import that breaks it. Beside them, a ceiling on file length."""

from __future__ import annotations

import pytest

from tests.test_import_graph import ROOT, import_graph

APP = ROOT / "app"
BELOW_SERVICES = (
    "app.common",
    "app.engine",
    "app.weights",
    "app.batching",
    "app.config",
    "app.config_groups",
    "app.errors",
    "app.words",
)
"""What every service stands on: none of these imports a service, a dialect or a route."""
ENTRY_POINTS = {"app.cli", "app.deploy.ray_serve"}
"""Modules that build the app (the command line, a Ray Serve replica)."""
LONG_FILES = {
    "app/config_groups.py": 734,
}
"""The one file over 500 lines, the settings list, at its length today: it may not grow, and
no other file may pass 500 lines."""
MAX_LINES = 500


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(APP)


def within(module: str, packages: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(f"{p}.") for p in packages)


def route_module(module: str) -> bool:
    """A module that declares routes (an `APIRouter`)."""
    parts = module.split(".")
    path = APP.joinpath(*parts[1:])
    source = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    return "APIRouter(" in source.read_text()


def test_the_modules_below_the_services_import_none_above_them(graph) -> None:
    upward = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if within(module, BELOW_SERVICES)
        for target in targets
        if not within(target, BELOW_SERVICES)
    )
    assert upward == []


def test_only_the_app_imports_a_dialect(graph) -> None:
    importers = sorted(
        module
        for module, targets in graph.items()
        if not within(module, ("app.dialects",))
        if any(within(t, ("app.dialects",)) for t in targets)
    )
    assert importers == ["app.main"]


def test_only_route_modules_import_the_composition_root(graph) -> None:
    importers = sorted(m for m, targets in graph.items() if "app.deps" in targets)
    assert len(importers) > 10
    assert [m for m in importers if not route_module(m)] == []
    assert [t for t in graph["app.deps"] if within(t, ("app.dialects",))] == []


def test_only_the_entry_points_import_the_app(graph) -> None:
    assert {m for m, targets in graph.items() if "app.main" in targets} <= ENTRY_POINTS


def test_no_file_passes_500_lines_but_the_ones_on_record() -> None:
    sources = [*APP.rglob("*.py"), *(ROOT / "clients").rglob("*.py")]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in sources}
    grown = {
        path: (n, LONG_FILES.get(path, MAX_LINES))
        for path, n in lengths.items()
        if n > LONG_FILES.get(path, MAX_LINES)
    }
    assert grown == {}, "(lines now, the ceiling)"
    # A file brought under 500 lines leaves the record, so it cannot grow back.
    assert {path for path in LONG_FILES if lengths.get(path, 0) <= MAX_LINES} == set()
