"""Dataset rows: a prompt (query), an optional ground-truth answer, and extra fields rewards
read (e.g. IFEval's instruction ids). JSONL is parsed and checked line by line; the first bad
line is refused by number and field, and nothing of a refused file is kept."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from app.common.failures import invalid
from app.envs.rewards import reward_of


@dataclass(frozen=True)
class Problem:
    query: str
    answer: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> list[Any]:
        return [self.query, self.answer, self.fields]

    @classmethod
    def from_json(cls, data: list[Any]) -> Problem:
        query, answer, fields = data
        return cls(query, answer, fields)


@dataclass(frozen=True)
class FieldMapping:
    """Which field of a row holds what: `extra` maps a name rewards read to the row's field."""

    query: str = "query"
    answer: str | None = "answer"
    extra: dict[str, str] = field(default_factory=dict)


def parse_jsonl(
    text: str,
    mapping: FieldMapping,
    *,
    param: str,
    max_rows: int | None = None,
    reward: str | None = None,
) -> list[Problem]:
    """Every non-blank line as a Problem; a 422 naming `param` with the line number and the
    row's field at fault for the first bad line (with `reward`: also a row it cannot score)."""
    check = None if reward is None else reward_of(reward).check_fields
    problems: list[Problem] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if max_rows is not None and len(problems) == max_rows:
            raise invalid(param, f"has more than {max_rows} rows (RLSERVE_DATASETS__MAX_ROWS)")
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise invalid(param, f"line {number}: not JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise invalid(param, f"line {number}: a row must be a JSON object")
        problem = _problem(row, mapping, number, param)
        if check is not None and (bad := check(problem.fields)) is not None:
            field, what = bad
            raise invalid(param, f"line {number}, field '{field}': {what} (reward '{reward}')")
        problems.append(problem)
    if not problems:
        raise invalid(param, "has no rows")
    return problems


def _problem(row: dict[str, Any], mapping: FieldMapping, number: int, param: str) -> Problem:
    def bad(name: str, what: str) -> Exception:
        return invalid(param, f"line {number}, field '{name}': {what}")

    query = row.get(mapping.query)
    if mapping.query not in row:
        raise bad(mapping.query, "missing (the query)")
    if not isinstance(query, str) or not query.strip():
        raise bad(mapping.query, "the query must be a non-empty string")
    answer = None
    if mapping.answer is not None:
        if mapping.answer not in row:
            raise bad(mapping.answer, "missing (the answer; map answer to null for none)")
        value = row[mapping.answer]
        if isinstance(value, bool) or not isinstance(value, str | int | float | None):
            raise bad(mapping.answer, "the answer must be a string, a number or null")
        answer = None if value is None else value if isinstance(value, str) else json.dumps(value)
    extra = {}
    for name, source in mapping.extra.items():
        if source not in row:
            raise bad(source, f"missing (mapped to '{name}')")
        extra[name] = row[source]
    return Problem(query, answer, extra)
