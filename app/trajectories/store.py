"""Where recorded trajectories live: each completion made in a trajectory is one turn, kept
token-exactly, appended atomically (two completions racing in one trajectory get turns k and
k + 1, never the same). A trajectory is its owner's: ids are scoped per key, and each key's
stored bytes are counted. SQLite in the session store's file by default, behind a small
interface like the session store's."""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.common.sqlite import SQLiteFile


@dataclass
class Turn:
    """One recorded completion: the prompt as templated and what the policy sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    """Raw log-probs of the completion tokens (the weights that sampled each)."""
    versions: list[list[int]]
    """[version, start, end] spans over the completion tokens."""
    finish_reason: str
    model: str
    created: float
    routed_experts: str | None = None
    """A mixture-of-experts policy's routing of every token the turn fed its model (prompt and
    completion but the last), as vLLM encodes it (`app.common.routed_experts.npy_base64`);
    recorded when the server returns routed experts."""


@dataclass
class Trajectory:
    trajectory_id: str
    owner: str
    turns: list[Turn]
    reward: float | None
    created_at: float
    updated_at: float


TURNS_FULL = -1
"""What `append` answers for a trajectory that already has its `max_turns` turns."""


def scoped(owner: str, trajectory_id: str) -> str:
    """Where a key's trajectory is kept: ids are the caller's own, so two keys that both name
    `episode-0` record two trajectories (an owner id never holds '/')."""
    return f"{owner}/{trajectory_id}"


class TrajectoryStore(ABC):
    """Trajectories by owner (the key that records them) and id: the same id under two owners
    is two trajectories. Each owner's stored bytes are counted (`usage`)."""

    @abstractmethod
    async def append(self, trajectory_id: str, owner: str, turn: Turn, max_turns: int) -> int:
        """Add `turn` as the next turn and return its index; `TURNS_FULL` when the trajectory
        already has `max_turns` turns (nothing is written)."""

    @abstractmethod
    async def get(self, trajectory_id: str, owner: str) -> Trajectory | None: ...

    @abstractmethod
    async def head(self, trajectory_id: str, owner: str) -> int | None:
        """Its number of turns (None: no such trajectory), without reading the turns."""

    @abstractmethod
    async def usage(self, owner: str) -> int:
        """Bytes the owner's trajectories hold (their turns as stored)."""

    @abstractmethod
    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> bool:
        """False when there is no such trajectory of this owner."""

    @abstractmethod
    async def delete(self, trajectory_id: str, owner: str) -> bool: ...

    @abstractmethod
    async def expire(self, idle_since: float) -> int:
        """Delete trajectories not updated since `idle_since`; how many."""

    async def aclose(self) -> None:  # noqa: B027 - nothing to release by default
        """Release connections."""


def _record(turn: Turn) -> str:
    return json.dumps(asdict(turn))


_SCHEMA = """
CREATE TABLE IF NOT EXISTS trajectories (
    trajectory_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    reward REAL,
    num_turns INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS trajectory_turns (
    trajectory_id TEXT NOT NULL REFERENCES trajectories (trajectory_id) ON DELETE CASCADE,
    turn INTEGER NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (trajectory_id, turn)
);
CREATE INDEX IF NOT EXISTS trajectories_updated ON trajectories (updated_at);
CREATE TABLE IF NOT EXISTS trajectory_usage (
    owner TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
"""
"""(`trajectory_id` holds `scoped(owner, id)`; `bytes`, added to files of earlier releases
below, counts each trajectory's stored turns, and `trajectory_usage` each owner's sum.)"""


class SQLiteTrajectoryStore(SQLiteFile, TrajectoryStore):
    """Every write is one transaction."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "trajectories", "foreign_keys=ON")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(trajectories)")}
        if "bytes" not in columns:
            self._db.execute("ALTER TABLE trajectories ADD COLUMN bytes INTEGER NOT NULL DEFAULT 0")

    def _transaction(self, fn: Any) -> Any:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    def _count(self, owner: str, change: int) -> None:
        self._db.execute(
            "INSERT INTO trajectory_usage (owner, bytes) VALUES (?, ?) "
            "ON CONFLICT (owner) DO UPDATE SET bytes = max(bytes + excluded.bytes, 0)",
            (owner, change),
        )

    async def append(self, trajectory_id: str, owner: str, turn: Turn, max_turns: int) -> int:
        key, record = scoped(owner, trajectory_id), _record(turn)

        def write() -> int:
            at = time.time()
            row = self._db.execute(
                "SELECT num_turns FROM trajectories WHERE trajectory_id = ?", (key,)
            ).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO trajectories (trajectory_id, owner, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?)",
                    (key, owner, at, at),
                )
                index = 0
            elif row[0] >= max_turns:
                return TURNS_FULL
            else:
                index = int(row[0])
            self._db.execute(
                "INSERT INTO trajectory_turns (trajectory_id, turn, record) VALUES (?, ?, ?)",
                (key, index, record),
            )
            self._db.execute(
                "UPDATE trajectories SET num_turns = ?, updated_at = ?, bytes = bytes + ? "
                "WHERE trajectory_id = ?",
                (index + 1, at, len(record), key),
            )
            self._count(owner, len(record))
            return index

        result: int = await self._run(self._transaction, write)
        return result

    async def get(self, trajectory_id: str, owner: str) -> Trajectory | None:
        key = scoped(owner, trajectory_id)

        def read() -> Trajectory | None:
            head = self._db.execute(
                "SELECT reward, created_at, updated_at FROM trajectories WHERE trajectory_id = ?",
                (key,),
            ).fetchone()
            if head is None:
                return None
            records = self._db.execute(
                "SELECT record FROM trajectory_turns WHERE trajectory_id = ? ORDER BY turn",
                (key,),
            ).fetchall()
            turns = [Turn(**json.loads(r[0])) for r in records]
            return Trajectory(trajectory_id, owner, turns, head[0], head[1], head[2])

        found: Trajectory | None = await self._run(self._transaction, read)
        return found

    async def head(self, trajectory_id: str, owner: str) -> int | None:
        def read() -> Any:
            return self._db.execute(
                "SELECT num_turns FROM trajectories WHERE trajectory_id = ?",
                (scoped(owner, trajectory_id),),
            ).fetchone()

        row = await self._run(read)
        return None if row is None else int(row[0])

    async def usage(self, owner: str) -> int:
        def read() -> Any:
            return self._db.execute(
                "SELECT bytes FROM trajectory_usage WHERE owner = ?", (owner,)
            ).fetchone()

        row = await self._run(read)
        return 0 if row is None else int(row[0])

    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> bool:
        def write() -> int:
            return int(
                self._db.execute(
                    "UPDATE trajectories SET reward = ?, updated_at = ? WHERE trajectory_id = ?",
                    (reward, time.time(), scoped(owner, trajectory_id)),
                ).rowcount
            )

        return bool(await self._run(write))

    async def delete(self, trajectory_id: str, owner: str) -> bool:
        key = scoped(owner, trajectory_id)

        def write() -> bool:
            row = self._db.execute(
                "SELECT bytes FROM trajectories WHERE trajectory_id = ?", (key,)
            ).fetchone()
            if row is None:
                return False
            self._db.execute("DELETE FROM trajectories WHERE trajectory_id = ?", (key,))
            self._count(owner, -int(row[0]))
            return True

        return bool(await self._run(self._transaction, write))

    async def expire(self, idle_since: float) -> int:
        def write() -> int:
            freed = self._db.execute(
                "SELECT owner, sum(bytes) FROM trajectories WHERE updated_at < ? GROUP BY owner",
                (idle_since,),
            ).fetchall()
            for owner, num_bytes in freed:
                self._count(owner, -int(num_bytes))
            return int(
                self._db.execute(
                    "DELETE FROM trajectories WHERE updated_at < ?", (idle_since,)
                ).rowcount
            )

        return int(await self._run(self._transaction, write))
