"""Where uploaded datasets live: beside the sessions (the same SQLite file, or the same Redis),
so every server that shares sessions shares datasets. A dataset is written in one transaction
(all its rows or none) and belongs to the API key that uploaded it."""

from __future__ import annotations

import json
import sqlite3
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.common.sqlite import SQLiteFile


@dataclass(frozen=True)
class DatasetMeta:
    name: str
    owner: str
    rows: int
    size_bytes: int
    fields: list[str]
    created_at: float


class DatasetExists(Exception):
    """The owner already has a dataset of that name."""


class TooManyDatasets(Exception):
    """The owner has as many datasets as allowed."""


class DatasetStore(ABC):
    @abstractmethod
    async def create(self, meta: DatasetMeta, rows: str, max_per_owner: int) -> None:
        """Store a new dataset (its rows as JSON) atomically; DatasetExists when the owner has
        one of that name, TooManyDatasets when they have `max_per_owner`."""

    @abstractmethod
    async def meta(self, owner: str, name: str) -> DatasetMeta | None: ...

    @abstractmethod
    async def rows(self, owner: str, name: str) -> str | None: ...

    @abstractmethod
    async def list(self, owner: str) -> list[DatasetMeta]: ...

    @abstractmethod
    async def delete(self, owner: str, name: str) -> bool: ...

    async def aclose(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    owner TEXT NOT NULL,
    name TEXT NOT NULL,
    meta TEXT NOT NULL,
    rows TEXT NOT NULL,
    PRIMARY KEY (owner, name)
);
"""


def _meta_json(meta: DatasetMeta) -> str:
    return json.dumps(meta.__dict__)


class SQLiteDatasetStore(SQLiteFile, DatasetStore):
    def __init__(self, path: Path) -> None:
        super().__init__(path, "datasets", "auto_vacuum=INCREMENTAL")
        self._db.executescript(_SCHEMA)

    async def create(self, meta: DatasetMeta, rows: str, max_per_owner: int) -> None:
        def write() -> None:
            try:
                inserted = self._db.execute(
                    "INSERT INTO datasets (owner, name, meta, rows) SELECT ?, ?, ?, ? "
                    "WHERE (SELECT COUNT(*) FROM datasets WHERE owner = ?) < ?",
                    (meta.owner, meta.name, _meta_json(meta), rows, meta.owner, max_per_owner),
                ).rowcount
            except sqlite3.IntegrityError:
                raise DatasetExists(meta.name) from None
            if not inserted:
                raise TooManyDatasets(meta.owner)

        await self._run(write)

    async def _column(self, column: str, owner: str, name: str) -> str | None:
        def query() -> Any:
            return self._db.execute(
                f"SELECT {column} FROM datasets WHERE owner = ? AND name = ?", (owner, name)
            ).fetchone()

        row = await self._run(query)
        return None if row is None else str(row[0])

    async def meta(self, owner: str, name: str) -> DatasetMeta | None:
        meta = await self._column("meta", owner, name)
        return None if meta is None else DatasetMeta(**json.loads(meta))

    async def rows(self, owner: str, name: str) -> str | None:
        return await self._column("rows", owner, name)

    async def list(self, owner: str) -> list[DatasetMeta]:
        def query() -> list[Any]:
            return self._db.execute(
                "SELECT meta FROM datasets WHERE owner = ? ORDER BY name", (owner,)
            ).fetchall()

        return [DatasetMeta(**json.loads(row[0])) for row in await self._run(query)]

    async def delete(self, owner: str, name: str) -> bool:
        def query() -> int:
            deleted = self._db.execute(
                "DELETE FROM datasets WHERE owner = ? AND name = ?", (owner, name)
            ).rowcount
            self._db.executescript("PRAGMA incremental_vacuum")
            return int(deleted)

        return bool(await self._run(query))


PREFIX = "rlserve:"

# KEYS: dataset hash, owner's set. ARGV: name, meta, rows, max per owner.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[4]) then return -1 end
redis.call('HSET', KEYS[1], 'meta', ARGV[2], 'rows', ARGV[3])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""


class RedisDatasetStore(DatasetStore):
    """A hash per dataset (`dataset:<owner>:<name>`, fields meta and rows) and a set of names
    per owner (`datasets:<owner>`), under the sessions' `rlserve:` prefix."""

    def __init__(self, url: str) -> None:
        from redis.asyncio import Redis

        self._redis: Any = Redis.from_url(url, decode_responses=True)
        self._create = self._redis.register_script(_CREATE)

    @staticmethod
    def _key(owner: str, name: str) -> str:
        return f"{PREFIX}dataset:{owner}:{name}"

    @staticmethod
    def _owner(owner: str) -> str:
        return f"{PREFIX}datasets:{owner}"

    async def create(self, meta: DatasetMeta, rows: str, max_per_owner: int) -> None:
        done = await self._create(
            keys=[self._key(meta.owner, meta.name), self._owner(meta.owner)],
            args=[meta.name, _meta_json(meta), rows, max_per_owner],
        )
        if done == 0:
            raise DatasetExists(meta.name)
        if done == -1:
            raise TooManyDatasets(meta.owner)

    async def meta(self, owner: str, name: str) -> DatasetMeta | None:
        meta = await self._redis.hget(self._key(owner, name), "meta")
        return None if meta is None else DatasetMeta(**json.loads(meta))

    async def rows(self, owner: str, name: str) -> str | None:
        rows = await self._redis.hget(self._key(owner, name), "rows")
        return None if rows is None else str(rows)

    async def list(self, owner: str) -> list[DatasetMeta]:
        names = sorted(await self._redis.smembers(self._owner(owner)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.hget(self._key(owner, name), "meta")
            found = await pipe.execute()
        return [DatasetMeta(**json.loads(meta)) for meta in found if meta is not None]

    async def delete(self, owner: str, name: str) -> bool:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._key(owner, name))
            pipe.srem(self._owner(owner), name)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def aclose(self) -> None:
        await self._redis.aclose()
