"""The trainers' own clients run in .venv-trainers (scripts/test-trainers.sh sets
RLSERVE_TRAINERS_SUITE=1); elsewhere these tests skip, saying where they run."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("RLSERVE_TRAINERS_SUITE") == "1":
        return
    skip = pytest.mark.skip(reason="a trainer's own client: run by scripts/test-trainers.sh")
    for item in items:
        if item.get_closest_marker("trainers") is not None:
            item.add_marker(skip)
