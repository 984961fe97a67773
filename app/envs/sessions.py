"""Environment sessions as stored: who owns them, how many a key may hold, when idle ones
expire, and the per-session lock under which a session is read, changed and saved over the
revision it was read at. A session also remembers its last keyed step, so a retried step is
answered as it was instead of applied twice."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.common.failures import NotFound, QuotaExceeded, Superseded, invalid
from app.envs.episodes import Act, EpisodeState, Row
from app.envs.spec import EnvSpec
from app.envs.store import SessionRecord, SessionStore, now


@dataclass(frozen=True)
class SessionLimits:
    max_sessions: int
    max_sessions_per_key: int
    ttl_s: float  # idle sessions expire after this


@dataclass(frozen=True)
class SessionView:
    """A session's configuration and episode state, as stored."""

    env_id: str
    config: EnvSpec
    started: bool
    rows: list[Row]
    created_at: float
    updated_at: float

    @classmethod
    def of(cls, record: SessionRecord) -> SessionView:
        state = EpisodeState.from_json(record.state)
        config = EnvSpec.from_json(record.config)
        return cls(
            record.env_id, config, state.started, state.rows, record.created_at, record.updated_at
        )


@dataclass
class Session:
    """A session opened for a change: its configuration and its episodes."""

    config: EnvSpec
    state: EpisodeState

    def replayed(self, key: str | None, actions: list[Act | None]) -> dict[str, Any] | None:
        """The answer of the last step, when it was sent with `key` (and the same actions)."""
        last = self.state.last_step
        if key is None or last is None or last["key"] != key:
            return None
        if last["digest"] != _digest(actions):
            raise invalid(
                "Idempotency-Key", "was used for a step with other actions; use a new key per step"
            )
        answer: dict[str, Any] = last["response"]
        return answer

    def remember(self, key: str, actions: list[Act | None], answer: dict[str, Any]) -> None:
        """Keep this step's answer for a retry with `key`."""
        self.state.last_step = {"key": key, "digest": _digest(actions), "response": answer}

    def forget_step(self) -> None:
        self.state.last_step = None


class SessionRepository:
    def __init__(self, store: SessionStore, limits: SessionLimits) -> None:
        self.store = store
        self.limits = limits
        self._locks: dict[str, asyncio.Lock] = {}

    async def create(self, config: EnvSpec, owner: str) -> SessionView:
        limits = self.limits
        if await self.store.count(owner) >= limits.max_sessions_per_key:
            raise QuotaExceeded(
                f"this API key has {limits.max_sessions_per_key} live environment "
                "sessions (RLSERVE_ENVS__MAX_SESSIONS_PER_KEY); delete one or wait for idle "
                "ones to expire"
            )
        if await self.store.count() >= limits.max_sessions:
            raise QuotaExceeded(
                f"{limits.max_sessions} environment sessions are live "
                "(RLSERVE_ENVS__MAX_SESSIONS); delete one or wait for idle ones to expire"
            )
        stamp = now()
        state = EpisodeState().to_json()
        record = SessionRecord(
            f"env-{uuid.uuid4().hex}", config.to_json(), state, stamp, stamp, owner
        )
        await self.store.put(record)
        return SessionView.of(record)

    async def get(self, env_id: str, owner: str) -> SessionView:
        return SessionView.of(await self._load(env_id, owner))

    async def delete(self, env_id: str, owner: str) -> None:
        await self._load(env_id, owner)
        await self._forget(env_id)

    async def page(self, owner: str, offset: int, limit: int) -> tuple[list[SessionView], int]:
        records, total = await self.store.page(owner, offset, limit)
        return [SessionView.of(r) for r in records], total

    async def count(self) -> int:
        """Live sessions, every key's."""
        return await self.store.count()

    async def reap(self) -> int:
        expired = await self.store.expire(now() - self.limits.ttl_s)
        for env_id in expired:
            self._locks.pop(env_id, None)
        return len(expired)

    async def _load(self, env_id: str, owner: str) -> SessionRecord:
        """The owner's session; another key's session is absent to this one (404 alike)."""
        record = await self.store.get(env_id)
        if record is not None and record.updated_at < now() - self.limits.ttl_s:
            await self._forget(env_id)
            record = None
        if record is None or not hmac.compare_digest(record.owner, owner):
            raise NotFound(f"environment '{env_id}' does not exist or expired")
        return record

    async def _forget(self, env_id: str) -> bool:
        self._locks.pop(env_id, None)
        return await self.store.delete(env_id)

    @contextlib.asynccontextmanager
    async def opened(self, env_id: str, owner: str) -> AsyncIterator[Session]:
        """The session under its lock; saved when the block completes without error (a
        failed step changes nothing). The save writes over the revision it read, so when
        another server changed the session meanwhile (two replicas sharing a store), this
        one's change is dropped: 409, and a retry with the same Idempotency-Key gets the step
        that was applied."""
        lock = self._locks.get(env_id)
        if lock is None:  # only sessions that exist get a lock (unknown ids leave nothing)
            await self._load(env_id, owner)
            lock = self._locks.setdefault(env_id, asyncio.Lock())
        async with lock:
            record = await self._load(env_id, owner)
            session = Session(
                EnvSpec.from_json(record.config), EpisodeState.from_json(record.state)
            )
            yield session
            record.state = session.state.to_json()
            record.updated_at = now()
            if not await self.store.replace(record):
                raise Superseded(
                    f"environment '{env_id}' changed while this request ran (another server "
                    "applied a step); this one was not applied: send it again with the same "
                    "Idempotency-Key",
                    param="env_id",
                )


def _digest(actions: list[Act | None]) -> str:
    """A step's actions, hashed: a retried step must carry the same ones."""
    plain = [None if a is None else [a.text, a.tokens] for a in actions]
    return hashlib.sha256(json.dumps(plain).encode()).hexdigest()
