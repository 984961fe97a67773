"""The example blocks of the README and the docs, as the docs runner sees them.

A fenced block tagged `bash` or `python` is an example and runs; any other tag (`console`,
`text`, `json`, `yaml`, ...) is shown only. An example that cannot run here says why on the
line just before its fence: `<!-- skip: needs a GPU host -->`. The examples of one page run in
order; its Python blocks share one interpreter (a later block may use an earlier block's
names), each bash block runs on its own."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash", "python"}
# Tags that look runnable but would be skipped silently: a writer must pick bash or console.
AMBIGUOUS = {"sh", "shell", "py", "python3", "zsh", "bash-session", "pycon"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # why it does not run, or None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def examples(page: Path) -> list[Example]:
    """Every fenced block of `page` tagged bash or python, in order."""
    found: list[Example] = []
    lines = page.read_text().splitlines()
    rel = str(page.relative_to(ROOT))
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        info = opening["info"].lower()
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        if j == len(lines):
            raise ValueError(f"{rel}:{i + 1}: the fenced block is never closed")
        if info in AMBIGUOUS:
            raise ValueError(f"{rel}:{i + 1}: tag `{info}`: use bash or python (runs) or console")
        if info in RUNNABLE:
            found.append(Example(rel, i + 1, info, "\n".join(body) + "\n", _skip(lines, i)))
        i = j + 1
    return found


def _skip(lines: list[str], fence: int) -> str | None:
    k = fence - 1
    while k >= 0 and not lines[k].strip():
        k -= 1
    if k < 0:
        return None
    marked = _SKIP.match(lines[k])
    if marked is None:
        return None
    if not marked["reason"]:
        raise ValueError("a skip marker must say why the example cannot run")
    return marked["reason"]


if __name__ == "__main__":  # python -m tests.docs.examples: what runs, what is skipped and why
    total = skipped = 0
    for page in pages():
        found = examples(page)
        total, skipped = total + len(found), skipped + sum(e.skip is not None for e in found)
        if found:
            print(f"{page.relative_to(ROOT)}: {len(found)} examples")
        for example in found:
            if example.skip is not None:
                print(f"  skip {example.name}: {example.skip}")
    print(f"{total} examples, {total - skipped} run, {skipped} skipped")
