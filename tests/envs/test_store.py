"""The SQLite session store: owners, a store written before owners existed, space given back
when sessions are deleted, and concurrent writes committed together."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path

import pytest

from app.common import jsontext
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


def counting_commits(store: SQLiteSessionStore) -> list[str]:
    """The transaction statements the store's connection runs from now on."""
    seen: list[str] = []

    def trace(statement: str) -> None:
        if statement.split()[0].upper() in {"BEGIN", "COMMIT", "ROLLBACK"}:
            seen.append(statement.split()[0].upper())

    store._db.set_trace_callback(trace)
    return seen


async def test_concurrent_steps_commit_together_and_each_is_on_disk(tmp_path: Path) -> None:
    """32 sessions written at once share a few transactions (one fsync each, not 32), and
    every write is in the file, read back by another connection, once its call returns."""
    path = tmp_path / "sessions.sqlite3"
    store = SQLiteSessionStore(path)
    try:
        records = [SessionRecord(f"env-{i}", {}, {"turn": 0}, 1.0, 1.0) for i in range(32)]
        await asyncio.gather(*(store.put(r) for r in records))
        statements = counting_commits(store)
        for record in records:
            record.state = {"turn": 1, "text": record.env_id}
        replaced = await asyncio.gather(*(store.replace(r) for r in records))
        assert replaced == [True] * 32
        commits = statements.count("COMMIT")
        assert 1 <= commits < 32 and "ROLLBACK" not in statements
        with sqlite3.connect(path) as other:
            rows = dict(other.execute("SELECT env_id, state FROM sessions"))
        assert all(json.loads(rows[r.env_id]) == {"turn": 1, "text": r.env_id} for r in records)
        assert all(r.revision == 1 for r in records)
    finally:
        await store.aclose()


async def test_a_failing_write_fails_alone(tmp_path: Path) -> None:
    """A write that raises inside a shared commit is rolled back and reaches its own caller;
    the writes beside it commit; a stale revision is refused, not written."""
    store = SQLiteSessionStore(tmp_path / "sessions.sqlite3")
    try:
        good = [SessionRecord(f"env-{i}", {}, {"n": i}, 1.0, 1.0) for i in range(4)]

        def failing() -> None:
            store._db.execute("UPDATE sessions SET state = 'half' WHERE env_id = 'env-0'")
            raise RuntimeError("a write that fails half way")

        results = await asyncio.gather(
            *(store.put(r) for r in good[:2]),
            store._write(failing),
            *(store.put(r) for r in good[2:]),
            return_exceptions=True,
        )
        assert isinstance(results[2], RuntimeError)
        assert [e for i, e in enumerate(results) if i != 2 and isinstance(e, Exception)] == []
        for i in range(4):
            record = await store.get(f"env-{i}")
            assert record is not None and record.state == {"n": i}
        stale = SessionRecord("env-1", {}, {"n": "stale"}, 1.0, 1.0, revision=5)
        assert not await store.replace(stale)
        record = await store.get("env-1")
        assert record is not None and record.state == {"n": 1}
    finally:
        await store.aclose()


async def test_a_write_to_a_closed_store_fails_at_once(tmp_path: Path) -> None:
    """After `aclose` (at shutdown) a write raises instead of waiting for a commit that can no
    longer come; a read does too."""
    store = SQLiteSessionStore(tmp_path / "sessions.sqlite3")
    await store.put(SessionRecord("env-0", {}, {"n": 0}, 1.0, 1.0))
    await store.aclose()
    record = SessionRecord("env-0", {}, {"n": 1}, 1.0, 1.0)
    for _ in range(2):  # the first failed write leaves nothing behind for the next to wait on
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(store.replace(record), timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(store.get("env-0"), timeout=10)


@pytest.mark.parametrize(
    "value",
    [
        {"ids": list(range(300)), "text": 'é \u2028 "q" \\', "reward": 0.1, "big": 10**30},
        {"reward": float("inf"), "low": float("-inf"), "none": None, "flags": [True, False]},
        {"lone": "\ud800 surrogate", "nested": [{"a": []}, {}]},
    ],
)
def test_session_json_reads_back_and_reads_the_standard_librarys(value):
    """Sessions are written by a faster encoder; what it writes reads back as the value, and
    so does what the standard library wrote (sessions stored before)."""
    assert jsontext.loads(jsontext.dumps(value)) == value
    assert json.loads(jsontext.dumps(value)) == value
    assert jsontext.loads(json.dumps(value)) == value
