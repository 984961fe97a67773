"""The trainers guide's table of trainers (docs/guides/trainers.md) is the suite's: every test
a row names exists, and every test module with a trainer's own code is in a row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "trainers.md"


def table_rows() -> list[list[str]]:
    lines = GUIDE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| trainer (release) |"))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def named_tests(cell: str) -> list[tuple[Path, str | None]]:
    """The tests a row's last cell names: `path` or `path::test_function`."""
    found = []
    for ref in re.findall(r"`(tests/[^`]+)`", cell):
        path, _, function = ref.partition("::")
        found.append((ROOT / path, function or None))
    return found


def test_every_row_names_tests_that_exist():
    rows = table_rows()
    assert len(rows) >= 10
    for row in rows:
        tests = named_tests(row[-1])
        assert tests, f"row '{row[0]}' names no test"
        for path, function in tests:
            assert path.is_file(), f"row '{row[0]}': {path} does not exist"
            if function is not None:
                defined = {
                    node.name
                    for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                }
                assert function in defined, f"row '{row[0]}': no {function} in {path}"


def test_every_trainer_test_is_in_the_table():
    named = {path for row in table_rows() for path, _ in named_tests(row[-1])}
    trainers = set((ROOT / "tests" / "trainers").glob("test_*.py"))
    replays = {
        ROOT / "tests" / "weights" / "test_slime_replay.py",
        ROOT / "tests" / "dialects" / "test_prime_rl_admin.py",
        ROOT / "tests" / "dialects" / "test_trl_client.py",
    }
    assert trainers | replays <= named, sorted(str(p) for p in (trainers | replays) - named)
