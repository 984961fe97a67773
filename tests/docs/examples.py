"""The example blocks of the README and the docs, as the docs runner sees them.

A fenced block tagged `bash` or `python` is an example and runs; any other tag (`console`,
`text`, `json`, `yaml`, ...) is shown only. An example that cannot run here says why on the
line just before its fence: `<!-- skip: needs a GPU host -->`. The examples of one page run in
order; its Python blocks share one interpreter (a later block may use an earlier block's
names), each bash block runs on its own.

A `console`, `text` or `json` block right after an example (blank lines between at most) is
what the example prints, and is compared with what it printed (`shown_matches`): whitespace
runs are one space; `…` (or `...`) stands for any text; ids and times are masked (hex runs of
12 or more, `chatcmpl-`/`cmpl-` ids, epoch and ISO times, temporary paths, the server's
port); numbers agree within a relative 1e-3 (and 1e-4 absolute), the rest of the text
exactly. A page that changes
the server's state in ways its shown output counts on (weight versions) says
`<!-- docs: fresh server -->` and gets a server of its own."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNABLE = {"bash", "python"}
# Tags that look runnable but would be skipped silently: a writer must pick bash or console.
AMBIGUOUS = {"sh", "shell", "py", "python3", "zsh", "bash-session", "pycon"}
_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^`\s]*)")
_SKIP = re.compile(r"^\s*<!--\s*skip:\s*(?P<reason>.*?)\s*-->\s*$")
SHOWN = {"console", "text", "json"}
FRESH_SERVER = "<!-- docs: fresh server -->"


@dataclass(frozen=True)
class Example:
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    skip: str | None  # why it does not run, or None
    shown: str | None = None  # what the page shows it prints (the block after it), or None

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [
        ROOT / "README.md",
        ROOT / "clients" / "python" / "README.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


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
            code = "\n".join(body) + "\n"
            found.append(Example(rel, i + 1, info, code, _skip(lines, i), _shown(lines, j + 1)))
        i = j + 1
    return found


def _shown(lines: list[str], after: int) -> str | None:
    """The output block right after an example's closing fence (line index `after`)."""
    k = after
    while k < len(lines) and not lines[k].strip():
        k += 1
    opening = _FENCE.match(lines[k]) if k < len(lines) else None
    if opening is None or opening["info"].lower() not in SHOWN:
        return None
    end = k + 1
    while end < len(lines) and not lines[end].strip().startswith(opening["fence"]):
        end += 1
    return "\n".join(lines[k + 1 : end])


_MASKS = [
    (re.compile(r"(chatcmpl|cmpl)-[\w-]+"), "<id>"),
    (re.compile(r"\b[0-9a-f]{12,}\b"), "<id>"),
    (re.compile(r"/tmp/[^\s\"',)]+"), "<path>"),
    (re.compile(r"\b(localhost|127\.0\.0\.1):\d+"), "localhost:<port>"),
    (re.compile(r"\b\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d[.,]?\d*([+-]\d\d:\d\d|Z)?"), "<time>"),
    (re.compile(r"\b1[6-9]\d{8}(\.\d+)?\b"), "<time>"),
]
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _masked(text: str) -> str:
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return " ".join(text.split())


def shown_matches(shown: str, printed: str) -> bool:
    """Whether `printed` is what the page shows (`shown`), by the rules of the module's doc."""
    pattern, numbers = "", []
    for piece in re.split(r"(…|\.\.\.|" + _NUMBER.pattern + ")", _masked(shown)):
        if piece in ("…", "..."):
            pattern += ".*?"
        elif _NUMBER.fullmatch(piece or " "):
            pattern += f"({_NUMBER.pattern})"
            numbers.append(float(piece))
        else:
            pattern += re.escape(piece)
    found = re.fullmatch(pattern, _masked(printed), re.S)
    if found is None:
        return False
    got = [float(g) for g in found.groups()]
    return all(
        math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-4) for a, b in zip(numbers, got, strict=True)
    )


def fresh_server(page: Path) -> bool:
    return FRESH_SERVER in page.read_text()


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
