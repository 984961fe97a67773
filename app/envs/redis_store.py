"""Sessions in Redis (`RLSERVE_STORAGE__SESSION_STORE=redis://host:port/db`), for several
servers that share them: the same interface as the SQLite store, and the same compare-and-set
`replace` (a Lua script, so it is atomic on the server), so a step is applied once or not at all
even when two replicas receive the same session.

Layout, under the `rlserve:` prefix: a hash per session (`session:<id>`), a sorted set of all
sessions by last update (`sessions:updated`, for expiry and counting) and one per owner by
creation (`sessions:owner:<owner>`, for listing)."""

from __future__ import annotations

from typing import Any

from app.common import jsontext
from app.envs.store import SessionRecord, SessionStore

PREFIX = "rlserve:"
_UPDATED = PREFIX + "sessions:updated"

# KEYS: session hash, updated set. ARGV: expected revision, config, state, updated_at, id.
_REPLACE = """
local current = redis.call('HGET', KEYS[1], 'revision')
if not current or tonumber(current) ~= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'config', ARGV[2], 'state', ARGV[3], 'updated_at', ARGV[4],
           'revision', tonumber(ARGV[1]) + 1)
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
return 1
"""
# KEYS: session hash, updated set. ARGV: id, owner-set prefix.
_DELETE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', ARGV[2] .. owner, ARGV[1])
return 1
"""


def _key(env_id: str) -> str:
    return f"{PREFIX}session:{env_id}"


def _owner_key(owner: str) -> str:
    return f"{PREFIX}sessions:owner:{owner}"


class RedisSessionStore(SessionStore):
    def __init__(self, url: str) -> None:
        from redis.asyncio import Redis

        # Any: redis-py types replies as bytes | str whatever decode_responses says.
        self._redis: Any = Redis.from_url(url, decode_responses=True)
        self._replace = self._redis.register_script(_REPLACE)
        self._delete = self._redis.register_script(_DELETE)

    async def put(self, record: SessionRecord) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(_key(record.env_id), mapping=_fields(record))
            pipe.zadd(_UPDATED, {record.env_id: record.updated_at})
            pipe.zadd(_owner_key(record.owner), {record.env_id: record.created_at})
            await pipe.execute()

    async def replace(self, record: SessionRecord) -> bool:
        done = await self._replace(
            keys=[_key(record.env_id), _UPDATED],
            args=[
                record.revision,
                jsontext.dumps(record.config),
                jsontext.dumps(record.state),
                repr(record.updated_at),
                record.env_id,
            ],
        )
        if not done:
            return False
        record.revision += 1
        return True

    async def get(self, env_id: str) -> SessionRecord | None:
        fields = await self._redis.hgetall(_key(env_id))
        return _record(env_id, fields) if fields else None

    async def delete(self, env_id: str) -> bool:
        deleted = await self._delete(
            keys=[_key(env_id), _UPDATED], args=[env_id, f"{PREFIX}sessions:owner:"]
        )
        return bool(deleted)

    async def page(self, owner: str, offset: int, limit: int) -> tuple[list[SessionRecord], int]:
        ids = await self._redis.zrange(_owner_key(owner), offset, offset + limit - 1)
        total = int(await self._redis.zcard(_owner_key(owner)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for env_id in ids:
                pipe.hgetall(_key(env_id))
            rows = await pipe.execute()
        return [_record(i, f) for i, f in zip(ids, rows, strict=True) if f], total

    async def count(self, owner: str | None = None) -> int:
        key = _UPDATED if owner is None else _owner_key(owner)
        return int(await self._redis.zcard(key))

    async def expire(self, idle_since: float) -> list[str]:
        ids = await self._redis.zrangebyscore(_UPDATED, "-inf", f"({idle_since!r}")
        gone = []
        for env_id in ids:
            if await self.delete(env_id):
                gone.append(env_id)
        return gone

    async def aclose(self) -> None:
        await self._redis.aclose()


def _fields(record: SessionRecord) -> dict[str, Any]:
    return {
        "config": jsontext.dumps(record.config),
        "state": jsontext.dumps(record.state),
        "created_at": repr(record.created_at),
        "updated_at": repr(record.updated_at),
        "owner": record.owner,
        "revision": record.revision,
    }


def _record(env_id: str, fields: dict[str, str]) -> SessionRecord:
    return SessionRecord(
        env_id=env_id,
        config=jsontext.loads(fields["config"]),
        state=jsontext.loads(fields["state"]),
        created_at=float(fields["created_at"]),
        updated_at=float(fields["updated_at"]),
        owner=fields["owner"],
        revision=int(fields["revision"]),
    )
