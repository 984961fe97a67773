"""Where environment sessions live. The interface is small so a shared store (e.g. Redis) can
serve several replicas later; SQLite (WAL, synchronous FULL) is the default: a step that
answered is on disk, so a restart, even kill -9, loses no completed step."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class SessionRecord:
    env_id: str
    config: dict[str, Any]
    state: dict[str, Any]
    created_at: float
    updated_at: float


class SessionStore(ABC):
    @abstractmethod
    async def put(self, record: SessionRecord) -> None:
        """Insert or replace a session (one atomic write)."""

    @abstractmethod
    async def get(self, env_id: str) -> SessionRecord | None: ...

    @abstractmethod
    async def delete(self, env_id: str) -> bool: ...

    @abstractmethod
    async def page(self, offset: int, limit: int) -> tuple[list[SessionRecord], int]:
        """Sessions by creation time, and the total count."""

    @abstractmethod
    async def count(self) -> int: ...

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
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_updated ON sessions (updated_at);
"""


class SQLiteSessionStore(SessionStore):
    """One connection used from one worker thread, so SQLite never blocks the event loop."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sessions")
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def put(self, record: SessionRecord) -> None:
        row = (
            record.env_id,
            json.dumps(record.config),
            json.dumps(record.state),
            record.created_at,
            record.updated_at,
        )
        await self._run(
            self._db.execute, "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?, ?)", row
        )

    async def get(self, env_id: str) -> SessionRecord | None:
        def query() -> Any:
            return self._db.execute("SELECT * FROM sessions WHERE env_id = ?", (env_id,)).fetchone()

        row = await self._run(query)
        return None if row is None else _record(row)

    async def delete(self, env_id: str) -> bool:
        def query() -> int:
            return self._db.execute("DELETE FROM sessions WHERE env_id = ?", (env_id,)).rowcount

        return bool(await self._run(query))

    async def page(self, offset: int, limit: int) -> tuple[list[SessionRecord], int]:
        def query() -> tuple[list[Any], int]:
            rows = self._db.execute(
                "SELECT * FROM sessions ORDER BY created_at, env_id LIMIT ? OFFSET ?",
                (limit, offset),
            ).fetchall()
            (total,) = self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()
            return rows, int(total)

        rows, total = await self._run(query)
        return [_record(row) for row in rows], total

    async def count(self) -> int:
        def query() -> int:
            return int(self._db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0])

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
            return ids

        return list(await self._run(query))

    async def aclose(self) -> None:
        await self._run(self._db.close)
        self._worker.shutdown(wait=True)


def _record(row: Any) -> SessionRecord:
    env_id, config, state, created_at, updated_at = row
    return SessionRecord(env_id, json.loads(config), json.loads(state), created_at, updated_at)


def now() -> float:
    return time.time()
