"""One SQLite file as the stores use it: one connection, used from one worker thread so SQLite
never blocks the event loop; WAL with synchronous FULL, so a write that returned is on disk
(a restart, even kill -9, loses none).

Writes that arrive together commit together (group commit): each runs in a savepoint of one
transaction, and all of them answer once that transaction is on disk. One fsync then carries
every concurrent environment step instead of one each; a write that fails is rolled back alone
and fails alone."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.common.lane import Lane, settle

_Pending = tuple[Callable[[], Any], asyncio.Future[Any]]


class SQLiteFile:
    def __init__(self, path: Path, thread_name: str, *pragmas: str) -> None:
        """`pragmas` run first (before the journal mode: auto_vacuum must)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self._worker = Lane(thread_name)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        for pragma in pragmas:
            self._db.execute(f"PRAGMA {pragma}")
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._pending: list[_Pending] = []
        self._pending_lock = threading.Lock()

    async def _run(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the connection's thread."""
        return await self._worker.run(fn, *args)

    async def _write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)`, statements that change the file and open no transaction of their own,
        committed with whatever other writes are waiting (group commit); its result once the
        transaction is on disk."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        with self._pending_lock:
            self._pending.append((lambda: fn(*args), future))
            first = len(self._pending) == 1
        if first:  # later writes join this commit until the connection's thread takes them
            try:
                self._worker.submit(self._commit_pending)
            except RuntimeError as closed:  # no commit will come: fail whoever joined too
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                for _fn, waiting in batch:
                    if waiting is not future and not waiting.done():
                        waiting.set_exception(closed)
                raise
        return await future

    def _commit_pending(self) -> None:
        with self._pending_lock:
            batch, self._pending = self._pending, []
        outcomes: list[tuple[bool, Any]] = []
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for fn, _future in batch:
                self._db.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, fn()))
                except BaseException as error:  # handed to its own caller
                    self._db.execute("ROLLBACK TO write")
                    outcomes.append((False, error))
                self._db.execute("RELEASE write")
            self._db.execute("COMMIT")
        except BaseException as error:  # the commit failed: every write did
            with contextlib.suppress(sqlite3.Error):  # (a closed connection has no state)
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
            outcomes = [(False, error)] * len(batch)
        # (a write whose caller stopped waiting stands)
        for (_fn, future), outcome in zip(batch, outcomes, strict=True):
            future.get_loop().call_soon_threadsafe(settle, future, *outcome)

    async def aclose(self) -> None:
        await self._run(self._db.close)
        self._worker.close(wait=True)
