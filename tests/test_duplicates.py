"""The tree's repeated code held to today's figures as ceilings, counted by the `duplicates`
command of the development machines (pairs of places sharing six or more lines, the same or
of the same shape). A change that repeats itself past a ceiling fails here; one that removes
repetition lowers the ceiling with it. Where the command is not installed, the test says so
and skips."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CEILINGS = {".": 148, "app": 95}
"""Pairs of places, for the whole tree and for `app/` (December 2026)."""

pytestmark = pytest.mark.skipif(
    shutil.which("duplicates") is None, reason="the duplicates command is not installed here"
)


def pairs(folder: str) -> int:
    run = subprocess.run(
        ["duplicates", "--repo", str(ROOT / folder), "--seconds", "120"],
        capture_output=True,
        text=True,
        check=True,
    )
    first = run.stdout.splitlines()[0]
    assert "incomplete" not in run.stdout, run.stdout
    if first.startswith("no duplicates"):
        return 0
    found = re.match(r"(\d+) pairs? of places", first)
    assert found is not None, first
    return int(found.group(1))


@pytest.mark.parametrize("folder", sorted(CEILINGS))
def test_the_tree_repeats_itself_no_more_than_it_did(folder: str) -> None:
    assert pairs(folder) <= CEILINGS[folder]
