"""Datasets by name: the bundled ones every key sees, and those each API key uploads (JSONL,
inline or from the import directory), checked row by row before anything is stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from app.common.failures import Conflict, NotFound, QuotaExceeded, TooLarge, invalid
from app.config import Settings
from app.datasets.bundled import BundledDatasets
from app.datasets.protocol import DatasetInfo, DatasetList, DatasetUpload
from app.datasets.rows import FieldMapping, Problem, parse_jsonl
from app.datasets.store import DatasetExists, DatasetMeta, DatasetStore, TooManyDatasets
from app.envs.rewards import first_bad_row, require

_CACHED = 8
"""Parsed uploaded datasets kept in memory (episodes draw from them at every reset)."""


class DatasetService:
    def __init__(self, store: DatasetStore, bundled: BundledDatasets, settings: Settings) -> None:
        self.store = store
        self.bundled = bundled
        self.settings = settings
        self.import_dir = settings.dataset_import_dir or settings.data_dir / "imports"
        self._cache: OrderedDict[tuple[str, str], _Parsed] = OrderedDict()
        self._checked: dict[tuple[str, str], RowProblem | None] = {}  # bundled, per reward

    async def upload(self, request: DatasetUpload, owner: str) -> DatasetInfo:
        if self.bundled.get(request.name) is not None:
            raise Conflict(
                f"'{request.name}' is a bundled dataset; pick another name", param="name"
            )
        if request.reward is not None:
            await require(request.reward)
        param = "jsonl" if request.jsonl is not None else "path"
        text = request.jsonl if request.jsonl is not None else await self._read(request.path)
        size = len(text.encode())
        if size > self.settings.dataset_max_bytes:
            raise TooLarge(
                f"{param}: {size} bytes exceed the limit of {self.settings.dataset_max_bytes} "
                "(RLSERVE_DATASET_MAX_BYTES)",
                param=param,
            )
        fields = request.fields
        mapping = FieldMapping(fields.query, fields.answer, dict(fields.extra))
        problems = await asyncio.to_thread(
            parse_jsonl, text, mapping, param=param, max_rows=self.settings.dataset_max_rows
        )
        if request.reward is not None:
            await self._check_rows(request.reward, problems, param, text)
        meta = DatasetMeta(
            name=request.name,
            owner=owner,
            rows=len(problems),
            size_bytes=size,
            fields=sorted(mapping.extra),
            created_at=time.time(),
        )
        rows = json.dumps([p.to_json() for p in problems])
        try:
            await self.store.create(meta, rows, self.settings.max_datasets_per_key)
        except DatasetExists:
            raise Conflict(
                f"a dataset named '{request.name}' exists; delete it first", param="name"
            ) from None
        except TooManyDatasets:
            raise QuotaExceeded(
                f"this API key has {self.settings.max_datasets_per_key} datasets "
                "(RLSERVE_MAX_DATASETS_PER_KEY); delete one first"
            ) from None
        return _info(meta)

    async def _read(self, path: str | None) -> str:
        """The file, only from inside the import directory (symbolic links resolved first)."""
        base = self.import_dir.resolve()
        outside = invalid(
            "path", f"must name a JSONL file under the server's import directory ({base})"
        )
        try:
            target = (base / (path or "")).resolve()
            if not target.is_relative_to(base) or not target.is_file():
                raise outside
            size = target.stat().st_size
        except (OSError, ValueError, RuntimeError):  # too long a name, a NUL, a loop of links
            raise outside from None
        if size > self.settings.dataset_max_bytes:
            raise TooLarge(
                f"path: {size} bytes exceed the limit of {self.settings.dataset_max_bytes} "
                "(RLSERVE_DATASET_MAX_BYTES)",
                param="path",
            )
        try:
            return await asyncio.to_thread(target.read_text, encoding="utf-8")
        except UnicodeDecodeError as error:
            raise invalid("path", f"is not UTF-8 text ({error.reason})") from None
        except OSError as error:
            raise invalid("path", f"cannot be read by the server ({error.strerror})") from None

    @staticmethod
    async def _check_rows(reward: str, problems: list[Problem], param: str, text: str) -> None:
        bad = await _first_bad_row(reward, problems)
        if bad is not None:
            index, field, what = bad
            line = _line_of(text, index)
            raise invalid(param, f"line {line}, field '{field}': {what} (reward '{reward}')")

    async def problems(self, name: str, owner: str) -> list[Problem] | None:
        """A dataset's rows as this key sees them: a bundled one, or one it uploaded."""
        bundled = self.bundled.get(name)
        if bundled is not None:
            return bundled
        parsed = await self._parsed(name, owner)
        return None if parsed is None else parsed.problems

    async def first_bad_row(
        self, name: str, owner: str, reward: str, problems: list[Problem]
    ) -> RowProblem | None:
        """The first row of the dataset the reward cannot score, checked once per dataset and
        reward (sessions check at creation and at every reset)."""
        if self.bundled.get(name) is not None:
            checked = self._checked
            key = (name, reward)
        else:
            parsed = self._cache.get((owner, name))
            if parsed is None or parsed.problems is not problems:
                return await _first_bad_row(reward, problems)
            checked, key = parsed.checked, ("", reward)
        if key not in checked:
            checked[key] = await _first_bad_row(reward, problems)
        return checked[key]

    async def _parsed(self, name: str, owner: str) -> _Parsed | None:
        meta = await self.store.meta(owner, name)
        if meta is None:
            return None
        cached = self._cache.get((owner, name))
        if cached is not None and cached.created_at == meta.created_at:
            self._cache.move_to_end((owner, name))
            return cached
        rows = await self.store.rows(owner, name)
        if rows is None:
            return None
        parsed = _Parsed(meta.created_at, await asyncio.to_thread(_decode, rows))
        self._cache[(owner, name)] = parsed
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return parsed

    async def names(self, owner: str) -> list[str]:
        return self.bundled.names() + [m.name for m in await self.store.list(owner)]

    async def list(self, owner: str) -> DatasetList:
        bundled = [self._bundled_info(name) for name in self.bundled.names()]
        return DatasetList(datasets=bundled + [_info(m) for m in await self.store.list(owner)])

    async def get(self, name: str, owner: str) -> DatasetInfo:
        if self.bundled.get(name) is not None:
            return self._bundled_info(name)
        meta = await self.store.meta(owner, name)
        if meta is None:
            raise NotFound(f"dataset '{name}' does not exist")
        return _info(meta)

    async def delete(self, name: str, owner: str) -> None:
        if self.bundled.get(name) is not None:
            raise Conflict(f"'{name}' is a bundled dataset and cannot be deleted", param="name")
        if not await self.store.delete(owner, name):
            raise NotFound(f"dataset '{name}' does not exist")
        self._cache.pop((owner, name), None)

    def _bundled_info(self, name: str) -> DatasetInfo:
        problems = self.bundled.get(name) or []
        fields = sorted({key for p in problems for key in p.fields})
        return DatasetInfo(name=name, rows=len(problems), size_bytes=0, fields=fields, bundled=True)


RowProblem = tuple[int, str, str]
"""A row a reward cannot score: (index, field, what is wrong)."""


@dataclass
class _Parsed:
    created_at: float
    problems: list[Problem]
    checked: dict[tuple[str, str], RowProblem | None] = field(default_factory=dict)


async def _first_bad_row(reward: str, problems: list[Problem]) -> RowProblem | None:
    return await asyncio.to_thread(first_bad_row, reward, [p.fields for p in problems])


def _info(meta: DatasetMeta) -> DatasetInfo:
    return DatasetInfo(
        name=meta.name,
        rows=meta.rows,
        size_bytes=meta.size_bytes,
        fields=meta.fields,
        bundled=False,
        created_at=meta.created_at,
    )


def _decode(rows: str) -> list[Problem]:
    return [Problem.from_json(row) for row in json.loads(rows)]


def _line_of(text: str, index: int) -> int:
    """The line number of the index-th non-blank line."""
    seen = -1
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            seen += 1
            if seen == index:
                return number
    return index + 1
