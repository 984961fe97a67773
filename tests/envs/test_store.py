"""The SQLite session store: owners, a store written before owners existed, and space given
back when sessions are deleted."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from app.envs.store import SessionRecord, SQLiteSessionStore


async def test_a_store_from_before_owners_opens_with_its_sessions_unowned(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(
            "CREATE TABLE sessions (env_id TEXT PRIMARY KEY, config TEXT NOT NULL, "
            "state TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)"
        )
        db.execute("INSERT INTO sessions VALUES ('env-old', '{}', '{}', 1.0, 2.0)")
    store = SQLiteSessionStore(path)
    try:
        record = await store.get("env-old")
        assert record is not None and record.owner == "" and record.updated_at == 2.0
        await store.put(SessionRecord("env-new", {}, {}, 3.0, 3.0, owner="key-x"))
        assert await store.count() == 2
        assert await store.count("key-x") == 1
        page, total = await store.page("", 0, 10)
        assert [r.env_id for r in page] == ["env-old"] and total == 1
    finally:
        await store.aclose()


async def test_deleted_sessions_give_their_space_back(tmp_path: Path) -> None:
    path = tmp_path / "sessions.sqlite3"
    store = SQLiteSessionStore(path)
    big = {"history": "x" * (1 << 20)}
    try:
        for i in range(8):
            await store.put(SessionRecord(f"env-{i}", {}, big, 1.0, 1.0))
        await store._run(lambda: store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
        full = path.stat().st_size
        for i in range(8):
            assert await store.delete(f"env-{i}")
        await store._run(lambda: store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)"))
        assert full > 8 << 20
        assert path.stat().st_size < full // 8
    finally:
        await store.aclose()
