"""One SQLite file as the stores use it: one connection, used from one worker thread so SQLite
never blocks the event loop; WAL with synchronous FULL, so a write that returned is on disk
(a restart, even kill -9, loses none)."""

from __future__ import annotations

import asyncio
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any


class SQLiteFile:
    def __init__(self, path: Path, thread_name: str, *pragmas: str) -> None:
        """`pragmas` run first (before the journal mode: auto_vacuum must)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        for pragma in pragmas:
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the connection's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def aclose(self) -> None:
        await self._run(self._db.close)
        self._worker.shutdown(wait=True)
