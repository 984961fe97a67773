"""Prompt datasets by name: JSONL files of {"query", "answer"} from a directory, plus the bundled
arithmetic word problems (GSM8K format), generated here so nothing is downloaded."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ARITHMETIC = "arithmetic"


@dataclass(frozen=True)
class Problem:
    query: str
    answer: str


def arithmetic_problems(num_problems: int = 256, seed: int = 0) -> list[Problem]:
    """Small two-step word problems whose answers follow `#### ` as in GSM8K."""
    rng = random.Random(seed)
    names = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fay", "Gus", "Hana"]
    things = ["apples", "stamps", "marbles", "books", "shells", "coins"]
    problems = []
    for _ in range(num_problems):
        name, thing = rng.choice(names), rng.choice(things)
        start, bought, given = rng.randint(2, 60), rng.randint(2, 40), rng.randint(1, 30)
        end = start + bought - given
        query = (
            f"{name} has {start} {thing}. {name} buys {bought} more and gives {given} away. "
            f"How many {thing} does {name} have now?"
        )
        steps = f"{start} + {bought} = {start + bought}. {start + bought} - {given} = {end}."
        problems.append(Problem(query, f"{steps}\n#### {end}"))
    return problems


def load_jsonl(path: Path) -> list[Problem]:
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("query"), str) or not isinstance(row.get("answer"), str):
            raise ValueError(f"{path}:{number}: each line needs string 'query' and 'answer'")
        problems.append(Problem(row["query"], row["answer"]))
    return problems


class DatasetRegistry:
    """The bundled dataset plus every `*.jsonl` in `directory` (named by file stem)."""

    def __init__(self, directory: Path | None) -> None:
        self._datasets: dict[str, list[Problem]] = {ARITHMETIC: arithmetic_problems()}
        if directory is not None and directory.is_dir():
            for path in sorted(directory.glob("*.jsonl")):
                self._datasets[path.stem] = load_jsonl(path)

    def names(self) -> list[str]:
        return sorted(self._datasets)

    def get(self, name: str) -> list[Problem] | None:
        return self._datasets.get(name)
