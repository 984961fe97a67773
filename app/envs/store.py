"""Where environment sessions live. The interface is small so a shared store (e.g. Redis) can
serve several replicas later; SQLite (WAL, synchronous FULL) is the default: a step that
answered is on disk, so a restart, even kill -9, loses no completed step."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.common import jsontext
from app.common.sqlite import SQLiteFile

T = TypeVar("T")


@dataclass
class SessionRecord:
    env_id: str
    config: dict[str, Any]
    state: dict[str, Any]
    created_at: float
    updated_at: float
    owner: str = ""  # who created it (app.ops.auth.owner_of); "" when the server has no keys
    revision: int = 0
    """How many times it was written: `replace` writes only over the revision it read, so two
    servers that step one session at once cannot both apply their step."""


class SessionStore(ABC):
    @abstractmethod
    async def put(self, record: SessionRecord) -> None:
        """Insert or replace a session (one atomic write)."""

    @abstractmethod
    async def replace(self, record: SessionRecord) -> bool:
        """Write `record` only if the stored session is still at `record.revision` (then at
        revision + 1, which `record` takes too); False when it changed or is gone."""

    @abstractmethod
    async def get(self, env_id: str) -> SessionRecord | None: ...

    @abstractmethod
    async def delete(self, env_id: str) -> bool: ...

    @abstractmethod
    async def page(self, owner: str, offset: int, limit: int) -> tuple[list[SessionRecord], int]:
        """One owner's sessions by creation time, and their count."""

    @abstractmethod
    async def count(self, owner: str | None = None) -> int:
        """Sessions of one owner, or of all when `owner` is None."""

    @abstractmethod
    async def expire(self, idle_since: float) -> list[str]:
        """Delete sessions not updated since `idle_since` (a time.time() value)."""

    async def aclose(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections."""


_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    env_id TEXT PRIMARY KEY,
    config TEXT NOT NULL,
    state TEXT NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    owner TEXT NOT NULL DEFAULT '',
    revision INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_updated ON sessions (updated_at);
"""
_COLUMNS = "env_id, config, state, created_at, updated_at, owner, revision"


class SQLiteSessionStore(SQLiteFile, SessionStore):
    def __init__(self, path: Path) -> None:
        # Freed pages go back to the file system after deletes (see _shrink).
        super().__init__(path, "sessions", "auto_vacuum=INCREMENTAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sessions)")}
        if "owner" not in columns:  # a store written before sessions had owners
            self._db.execute("ALTER TABLE sessions ADD COLUMN owner TEXT NOT NULL DEFAULT ''")
        if "revision" not in columns:  # ... or revisions
            self._db.execute("ALTER TABLE sessions ADD COLUMN revision INTEGER NOT NULL DEFAULT 0")
        self._db.execute("CREATE INDEX IF NOT EXISTS sessions_owner ON sessions (owner)")

    async def put(self, record: SessionRecord) -> None:
        row = (
            record.env_id,
            jsontext.dumps(record.config),
            jsontext.dumps(record.state),
            record.created_at,
            record.updated_at,
            record.owner,
            record.revision,
        )
        await self._write(
            self._db.execute,
            f"INSERT OR REPLACE INTO sessions ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
            row,
        )

    async def replace(self, record: SessionRecord) -> bool:
        values = (
            jsontext.dumps(record.config),
            jsontext.dumps(record.state),
            record.updated_at,
            record.revision + 1,
            record.env_id,
            record.revision,
        )

        def write() -> int:
            return int(
                self._db.execute(
                    "UPDATE sessions SET config = ?, state = ?, updated_at = ?, revision = ? "
                    "WHERE env_id = ? AND revision = ?",
                    values,
                ).rowcount
            )

        if not await self._write(write):
            return False
        record.revision += 1
        return True

    async def get(self, env_id: str) -> SessionRecord | None:
        def query() -> Any:
            return self._db.execute(
                f"SELECT {_COLUMNS} FROM sessions WHERE env_id = ?", (env_id,)
            ).fetchone()

        row = await self._run(query)
        return None if row is None else _record(row)

    async def delete(self, env_id: str) -> bool:
        def query() -> int:
            deleted = self._db.execute("DELETE FROM sessions WHERE env_id = ?", (env_id,)).rowcount
            self._shrink()
            return deleted

        return bool(await self._run(query))

    async def page(self, owner: str, offset: int, limit: int) -> tuple[list[SessionRecord], int]:
        def query() -> tuple[list[Any], int]:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM sessions WHERE owner = ? "
                "ORDER BY created_at, env_id LIMIT ? OFFSET ?",
                (owner, limit, offset),
            ).fetchall()
            (total,) = self._db.execute(
                "SELECT COUNT(*) FROM sessions WHERE owner = ?", (owner,)
            ).fetchone()
            return rows, int(total)

        rows, total = await self._run(query)
        return [_record(row) for row in rows], total

    async def count(self, owner: str | None = None) -> int:
        def query() -> int:
            if owner is None:
                return int(self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])
            return int(
                self._db.execute(
                    "SELECT COUNT(*) FROM sessions WHERE owner = ?", (owner,)
                ).fetchone()[0]
            )

        return int(await self._run(query))

    async def expire(self, idle_since: float) -> list[str]:
        def query() -> list[str]:
            ids = [
                r[0]
                for r in self._db.execute(
                    "SELECT env_id FROM sessions WHERE updated_at < ?", (idle_since,)
                )
            ]
            self._db.execute("DELETE FROM sessions WHERE updated_at < ?", (idle_since,))
            self._shrink()
            return ids

        return list(await self._run(query))

    def _shrink(self) -> None:
        """Return the pages of deleted sessions to the file system (in the worker thread)."""
        # executescript steps the pragma to its end (execute would free a single page)
        self._db.executescript("PRAGMA incremental_vacuum")


def _record(row: Any) -> SessionRecord:
    env_id, config, state, created_at, updated_at, owner, revision = row
    return SessionRecord(
        env_id,
        jsontext.loads(config),
        jsontext.loads(state),
        created_at,
        updated_at,
        owner,
        revision,
    )


def now() -> float:
    return time.time()
