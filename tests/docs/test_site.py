"""The docs site builds with no warning: every page in the nav, every link and anchor found,
the routes rendered from the exported spec, the settings and the client generated."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.examples import ROOT

pytestmark = pytest.mark.slow


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-6000:]
    settings = (site / "reference" / "settings" / "index.html").read_text()
    assert "RLSERVE_MODELS__MODEL" in settings and "RLSERVE_AUTH__API_KEYS" in settings
    routes = (site / "reference" / "routes" / "index.html").read_text()
    assert "/v1/generate" in routes and "/v1/logprobs" in routes


def test_the_settings_reference_is_the_settings() -> None:
    """docs/reference/settings.md is committed (its links work in the repository too) and is
    exactly what app/config.py generates: regenerate it with
    `.venv/bin/python scripts/mkdocs_hooks.py` after changing a setting."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hooks", ROOT / "scripts" / "mkdocs_hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = ROOT / "docs" / "reference" / "settings.md"
    assert page.read_text() == hooks.settings_reference(), "regenerate the settings reference"


def test_every_link_of_a_page_works_in_the_repository_too() -> None:
    """A page read in the repository (not the built site) finds every page and figure it
    links: the figures are linked where the benchmarks write them, bench/results/."""
    import re

    from tests.docs.examples import pages

    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for page in pages():
        for target in link.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: {target}"
