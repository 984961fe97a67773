"""Recorded trajectories in Redis (with `RLSERVE_STORAGE__SESSION_STORE=redis://...`): a hash per
trajectory, a list of its turns, a sorted set by last write for expiry, and a hash of each owner's
stored bytes. Appending is one Lua script, so turns stay numbered 0, 1, ... whichever replica
records them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from app.trajectories.store import TURNS_FULL, Trajectory, TrajectoryStore, Turn, scoped

PREFIX = "rlserve:"
_UPDATED = PREFIX + "trajectories:updated"
_USAGE = PREFIX + "trajectories:bytes"

# KEYS: head hash, turns list, updated set, usage hash. ARGV: owner, max turns, turn JSON,
# now, scoped id.
_APPEND = """
local count = redis.call('LLEN', KEYS[2])
if count >= tonumber(ARGV[2]) then return -1 end
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'created_at', ARGV[4])
end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'bytes', string.len(ARGV[3]))
redis.call('HINCRBY', KEYS[4], ARGV[1], string.len(ARGV[3]))
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
return count
"""
# KEYS: head hash, updated set. ARGV: reward, now, scoped id.
_REWARD = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'reward', ARGV[1], 'updated_at', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[3])
return 1
"""
# KEYS: head hash, turns list, updated set, usage hash. ARGV: scoped id.
_DELETE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then
  redis.call('ZREM', KEYS[3], ARGV[1])
  return 0
end
local size = tonumber(redis.call('HGET', KEYS[1], 'bytes') or '0')
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
if redis.call('HINCRBY', KEYS[4], owner, -size) <= 0 then redis.call('HDEL', KEYS[4], owner) end
return 1
"""


def _keys(key: str) -> list[str]:
    head = f"{PREFIX}trajectory:{key}"
    return [head, head + ":turns"]


class RedisTrajectoryStore(TrajectoryStore):
    def __init__(self, url: str) -> None:
        from redis.asyncio import Redis

        # Any: redis-py types replies as bytes | str whatever decode_responses says.
        self._redis: Any = Redis.from_url(url, decode_responses=True)
        self._append = self._redis.register_script(_APPEND)
        self._reward = self._redis.register_script(_REWARD)
        self._delete = self._redis.register_script(_DELETE)

    async def append(self, trajectory_id: str, owner: str, turn: Turn, max_turns: int) -> int:
        key = scoped(owner, trajectory_id)
        index = await self._append(
            keys=[*_keys(key), _UPDATED, _USAGE],
            args=[owner, max_turns, json.dumps(asdict(turn)), repr(time.time()), key],
        )
        return TURNS_FULL if int(index) < 0 else int(index)

    async def get(self, trajectory_id: str, owner: str) -> Trajectory | None:
        head_key, turns_key = _keys(scoped(owner, trajectory_id))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(head_key)
            pipe.lrange(turns_key, 0, -1)
            head, turns = await pipe.execute()
        if not head:
            return None
        reward = head.get("reward")
        return Trajectory(
            trajectory_id=trajectory_id,
            owner=owner,
            turns=[Turn(**json.loads(t)) for t in turns],
            reward=float(reward) if reward is not None else None,
            created_at=float(head["created_at"]),
            updated_at=float(head["updated_at"]),
        )

    async def head(self, trajectory_id: str, owner: str) -> int | None:
        head_key, turns_key = _keys(scoped(owner, trajectory_id))
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.exists(head_key)
            pipe.llen(turns_key)
            exists, count = await pipe.execute()
        return int(count) if exists else None

    async def usage(self, owner: str) -> int:
        return int(await self._redis.hget(_USAGE, owner) or 0)

    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> bool:
        key = scoped(owner, trajectory_id)
        done = await self._reward(
            keys=[_keys(key)[0], _UPDATED], args=[repr(reward), repr(time.time()), key]
        )
        return bool(done)

    async def delete(self, trajectory_id: str, owner: str) -> bool:
        return await self._remove(scoped(owner, trajectory_id))

    async def _remove(self, key: str) -> bool:
        done = await self._delete(keys=[*_keys(key), _UPDATED, _USAGE], args=[key])
        return bool(done)

    async def expire(self, idle_since: float) -> int:
        keys = await self._redis.zrangebyscore(_UPDATED, "-inf", f"({idle_since!r}")
        removed = 0
        for key in keys:
            removed += int(await self._remove(key))
        return removed

    async def aclose(self) -> None:
        await self._redis.aclose()
