"""Where recorded trajectories live: each completion made in a trajectory is one turn, kept
token-exactly, appended atomically (two completions racing in one trajectory get turns k and
k + 1, never the same). SQLite in the session store's file by default, behind a small
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


class TrajectoryStore(ABC):
    @abstractmethod
    async def append(
        self, trajectory_id: str, owner: str, turn: Turn, max_turns: int
    ) -> int | None:
        """Add `turn` as the next turn and return its index; None when the trajectory
        belongs to another owner or already has `max_turns` turns (nothing is written)."""

    @abstractmethod
    async def get(self, trajectory_id: str) -> Trajectory | None: ...

    @abstractmethod
    async def head(self, trajectory_id: str) -> tuple[str, int] | None:
        """(owner, number of turns), without reading the turns."""

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
"""


class SQLiteTrajectoryStore(SQLiteFile, TrajectoryStore):
    """Every write is one transaction."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "trajectories", "foreign_keys=ON")
        self._db.executescript(_SCHEMA)

    def _transaction(self, fn: Any) -> Any:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            result = fn()
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return result

    async def append(
        self, trajectory_id: str, owner: str, turn: Turn, max_turns: int
    ) -> int | None:
        def write() -> int | None:
            at = time.time()
            row = self._db.execute(
                "SELECT owner, num_turns FROM trajectories WHERE trajectory_id = ?",
                (trajectory_id,),
            ).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO trajectories (trajectory_id, owner, created_at, updated_at) "
                    "VALUES (?, ?, ?, ?)",
                    (trajectory_id, owner, at, at),
                )
                index = 0
            elif row[0] != owner or row[1] >= max_turns:
                return None
            else:
                index = int(row[1])
            self._db.execute(
                "INSERT INTO trajectory_turns (trajectory_id, turn, record) VALUES (?, ?, ?)",
                (trajectory_id, index, json.dumps(asdict(turn))),
            )
            self._db.execute(
                "UPDATE trajectories SET num_turns = ?, updated_at = ? WHERE trajectory_id = ?",
                (index + 1, at, trajectory_id),
            )
            return index

        result: int | None = await self._run(self._transaction, write)
        return result

    async def get(self, trajectory_id: str) -> Trajectory | None:
        def read() -> Trajectory | None:
            head = self._db.execute(
                "SELECT owner, reward, created_at, updated_at FROM trajectories "
                "WHERE trajectory_id = ?",
                (trajectory_id,),
            ).fetchone()
            if head is None:
                return None
            records = self._db.execute(
                "SELECT record FROM trajectory_turns WHERE trajectory_id = ? ORDER BY turn",
                (trajectory_id,),
            ).fetchall()
            turns = [Turn(**json.loads(r[0])) for r in records]
            return Trajectory(trajectory_id, head[0], turns, head[1], head[2], head[3])

        found: Trajectory | None = await self._run(self._transaction, read)
        return found

    async def head(self, trajectory_id: str) -> tuple[str, int] | None:
        def read() -> Any:
            return self._db.execute(
                "SELECT owner, num_turns FROM trajectories WHERE trajectory_id = ?",
                (trajectory_id,),
            ).fetchone()

        row = await self._run(read)
        return None if row is None else (str(row[0]), int(row[1]))

    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> bool:
        def write() -> int:
            return int(
                self._db.execute(
                    "UPDATE trajectories SET reward = ?, updated_at = ? "
                    "WHERE trajectory_id = ? AND owner = ?",
                    (reward, time.time(), trajectory_id, owner),
                ).rowcount
            )

        return bool(await self._run(write))

    async def delete(self, trajectory_id: str, owner: str) -> bool:
        def write() -> int:
            return int(
                self._db.execute(
                    "DELETE FROM trajectories WHERE trajectory_id = ? AND owner = ?",
                    (trajectory_id, owner),
                ).rowcount
            )

        return bool(await self._run(write))

    async def expire(self, idle_since: float) -> int:
        def write() -> int:
            return int(
                self._db.execute(
                    "DELETE FROM trajectories WHERE updated_at < ?", (idle_since,)
                ).rowcount
            )

        return int(await self._run(write))
