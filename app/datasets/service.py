"""Datasets by name: the bundled ones every key sees, and those each API key uploads (JSONL,
inline or from the import directory), checked row by row before anything is stored."""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from app.common.failures import Conflict, NotFound, QuotaExceeded, TooLarge, invalid
from app.config_groups import DatasetSettings
from app.datasets.bundled import BundledDatasets
from app.datasets.protocol import DatasetInfo, DatasetList, DatasetUpload
from app.datasets.rows import FieldMapping, Problem, parse_jsonl
from app.datasets.store import DatasetExists, DatasetMeta, DatasetStore, TooManyDatasets
from app.envs.rewards import first_bad_row, require

_CACHED = 8
"""Parsed uploaded datasets kept in memory (episodes draw from them at every reset)."""


class DatasetService:
    def __init__(
        self,
        store: DatasetStore,
        bundled: BundledDatasets,
        settings: DatasetSettings,
        data_dir: Path,
    ) -> None:
        self.store = store
        self.bundled = bundled
        self.settings = settings
        self.import_dir = settings.import_dir or data_dir / "imports"
        self._cache: OrderedDict[tuple[str, str], _Parsed] = OrderedDict()
        self._bundled = {name: _Parsed(0.0, bundled.get(name) or []) for name in bundled.names()}

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
        self._check_size(param, size)
        fields = request.fields
        mapping = FieldMapping(fields.query, fields.answer, dict(fields.extra))
        problems = await asyncio.to_thread(
            parse_jsonl,
            text,
            mapping,
            param=param,
            max_rows=self.settings.max_rows,
            reward=request.reward,
        )
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
            await self.store.create(meta, rows, self.settings.max_per_key)
        except DatasetExists:
            raise Conflict(
                f"a dataset named '{request.name}' exists; delete it first", param="name"
            ) from None
        except TooManyDatasets:
            raise QuotaExceeded(
                f"this API key has {self.settings.max_per_key} datasets "
                "(RLSERVE_DATASETS__MAX_PER_KEY); delete one first"
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
        self._check_size("path", size)
        try:
            return await asyncio.to_thread(target.read_text, encoding="utf-8")
        except UnicodeDecodeError as error:
            raise invalid("path", f"is not UTF-8 text ({error.reason})") from None
        except OSError as error:
            raise invalid("path", f"cannot be read by the server ({error.strerror})") from None

    def _check_size(self, param: str, size: int) -> None:
        if size > self.settings.max_bytes:
            raise TooLarge(
                f"{param}: {size} bytes exceed the limit of {self.settings.max_bytes} "
                "(RLSERVE_DATASETS__MAX_BYTES)",
                param=param,
            )

    async def rows_for(
        self, name: str, owner: str, reward: str
    ) -> tuple[list[Problem], RowProblem | None] | None:
        """A dataset's rows as this key sees them (a bundled one, or one it uploaded), with the
        first row the reward cannot score, checked once per dataset and reward (sessions ask
        at creation and at every reset); None when there is no such dataset."""
        parsed = self._bundled.get(name) or await self._parsed(name, owner)
        if parsed is None:
            return None
        if reward not in parsed.checked:
            parsed.checked[reward] = await asyncio.to_thread(
                first_bad_row, reward, [p.fields for p in parsed.problems]
            )
        return parsed.problems, parsed.checked[reward]

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
    checked: dict[str, RowProblem | None] = field(default_factory=dict)
    """Per reward, the first row it cannot score."""


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
