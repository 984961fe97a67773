"""MkDocs hooks: the benchmark figures join the site from `bench/results/`, where the benchmarks
write them; the pages link them there (`../../bench/results/learning.png`, a link that works
in the repository), and the site's pages link the site's copies (`on_page_markdown`). The
settings reference, `docs/reference/settings.md`, is generated from `app.config` by this file
(`.venv/bin/python scripts/mkdocs_hooks.py`), and committed so its links work in the
repository too; tests/docs/test_site.py fails when it drifts."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ROOT / "bench" / "results"
SETTINGS_PAGE = ROOT / "docs" / "reference" / "settings.md"


FIGURE_LINK = re.compile(r"\]\(((?:\.\./)+)bench/results/([A-Za-z0-9_.-]+\.(?:png|svg))\)")


def on_page_markdown(markdown: str, page: Any, config: MkDocsConfig, files: Files) -> str:
    """A page's links to figures in `bench/results/` (the repository's) as links to the
    site's copies of them (`bench/NAME`, added by `on_files`)."""
    here = Path(config["docs_dir"]) / Path(page.file.src_uri).parent

    def site_link(match: re.Match[str]) -> str:
        if (here / match[1]).resolve() != ROOT:
            return match[0]  # not the repository's bench/results: left for the checks
        return f"]({os.path.relpath(f'bench/{match[2]}', Path(page.file.src_uri).parent)})"

    return FIGURE_LINK.sub(site_link, markdown)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    for figure in sorted([*FIGURES.glob("*.png"), *FIGURES.glob("*.svg")]):
        files.append(File.generated(config, f"bench/{figure.name}", abs_src_path=str(figure)))
    return files


def settings_reference() -> str:
    from app.config import Settings

    lines = [
        "# Settings",
        "",
        "Every setting is an environment variable, `RLSERVE_<GROUP>__<FIELD>`, read once at",
        "start-up and validated before any model loads (a wrong value stops the start with its",
        "name). `rlserve serve` takes the common ones as flags too (`rlserve serve --help`).",
        "This page is generated from `app/config.py` (`.venv/bin/python scripts/mkdocs_hooks.py`).",
        "",
    ]
    for group, field in Settings.model_fields.items():
        cls = field.annotation
        assert isinstance(cls, type) and issubclass(cls, BaseModel), group
        lines += [f"## `{group}`", "", _doc(cls), ""]
        lines += ["| variable | default | meaning |", "|---|---|---|"]
        for name, info in cls.model_fields.items():
            if not info.description:
                raise ValueError(f"settings field {group}.{name} has no description")
            env = f"RLSERVE_{group.upper()}__{name.upper()}"
            meaning = info.description.replace("|", "\\|")
            lines.append(f"| `{env}` | {_default(info)} | {meaning} |")
        lines.append("")
    return "\n".join(lines)


def _doc(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def _default(info: Any) -> str:
    value = info.default
    if value is PydanticUndefined and info.default_factory is not None:
        value = info.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, Path):
        value = str(value).replace(str(Path.home()), "~")
    if isinstance(value, BaseModel):
        return "see the group"
    if isinstance(value, (list, tuple)) and not value:
        return "empty"
    text = str(value).replace("|", "\\|")
    return f"`{text}`"


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    SETTINGS_PAGE.write_text(settings_reference())
    print(SETTINGS_PAGE)
