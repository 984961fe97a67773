"""The trainers' own clients run in .venv-trainers (scripts/test-trainers.sh sets
RLSERVE_TRAINERS_SUITE=1); elsewhere these tests skip, saying where they run."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.e2e.server import Server, running_server


@contextmanager
def served_beside(tmp: Path, **settings: str) -> Iterator[Server]:
    """A real server on the built-in policy, no reference, with `settings` (environment
    variables) for the models beside it; its data and log in `tmp`."""
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        **settings,
    }
    with running_server(env=env, log=tmp / "server.log") as running:
        yield running


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RLSERVE_TRAINERS_SUITE") == "1":
        return
    skip = pytest.mark.skip(reason="a trainer's own client: run by scripts/test-trainers.sh")
    for item in items:
        if item.get_closest_marker("trainers") is not None:
            item.add_marker(skip)
