"""Recorded trajectories in Redis (with `RLSERVE_STORAGE__SESSION_STORE=redis://...`): a hash per
trajectory, a list of its turns, and a sorted set by last write for expiry. Appending is one Lua
script, so turns stay numbered 0, 1, ... whichever replica records them."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from typing import Any

from app.trajectories.store import Trajectory, TrajectoryStore, Turn

PREFIX = "rlserve:"
_UPDATED = PREFIX + "trajectories:updated"

# KEYS: head hash, turns list, updated set. ARGV: owner, max turns, turn JSON, now, id.
_APPEND = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner and owner ~= ARGV[1] then return -1 end
local count = redis.call('LLEN', KEYS[2])
if count >= tonumber(ARGV[2]) then return -1 end
if not owner then
  redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'created_at', ARGV[4])
end
redis.call('RPUSH', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
return count
"""
# KEYS: head hash, updated set. ARGV: owner, reward, now, id.
_REWARD = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'reward', ARGV[2], 'updated_at', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
return 1
"""
# KEYS: head hash, turns list, updated set. ARGV: owner (empty: any), id.
_DELETE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner or (ARGV[1] ~= '' and owner ~= ARGV[1]) then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1
"""


def _keys(trajectory_id: str) -> list[str]:
    head = f"{PREFIX}trajectory:{trajectory_id}"
    return [head, head + ":turns"]


class RedisTrajectoryStore(TrajectoryStore):
    def __init__(self, url: str) -> None:
        from redis.asyncio import Redis

        # Any: redis-py types replies as bytes | str whatever decode_responses says.
        self._redis: Any = Redis.from_url(url, decode_responses=True)
        self._append = self._redis.register_script(_APPEND)
        self._reward = self._redis.register_script(_REWARD)
        self._delete = self._redis.register_script(_DELETE)

    async def append(
        self, trajectory_id: str, owner: str, turn: Turn, max_turns: int
    ) -> int | None:
        index = await self._append(
            keys=[*_keys(trajectory_id), _UPDATED],
            args=[owner, max_turns, json.dumps(asdict(turn)), repr(time.time()), trajectory_id],
        )
        return None if int(index) < 0 else int(index)

    async def get(self, trajectory_id: str) -> Trajectory | None:
        head_key, turns_key = _keys(trajectory_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(head_key)
            pipe.lrange(turns_key, 0, -1)
            head, turns = await pipe.execute()
        if not head:
            return None
        reward = head.get("reward")
        return Trajectory(
            trajectory_id=trajectory_id,
            owner=head["owner"],
            turns=[Turn(**json.loads(t)) for t in turns],
            reward=float(reward) if reward is not None else None,
            created_at=float(head["created_at"]),
            updated_at=float(head["updated_at"]),
        )

    async def head(self, trajectory_id: str) -> tuple[str, int] | None:
        head_key, turns_key = _keys(trajectory_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(head_key, "owner")
            pipe.llen(turns_key)
            owner, count = await pipe.execute()
        return None if owner is None else (str(owner), int(count))

    async def set_reward(self, trajectory_id: str, owner: str, reward: float) -> bool:
        done = await self._reward(
            keys=[_keys(trajectory_id)[0], _UPDATED],
            args=[owner, repr(reward), repr(time.time()), trajectory_id],
        )
        return bool(done)

    async def delete(self, trajectory_id: str, owner: str) -> bool:
        done = await self._delete(
            keys=[*_keys(trajectory_id), _UPDATED], args=[owner, trajectory_id]
        )
        return bool(done)

    async def expire(self, idle_since: float) -> int:
        ids = await self._redis.zrangebyscore(_UPDATED, "-inf", f"({idle_since!r}")
        removed = 0
        for trajectory_id in ids:
            keys = [*_keys(trajectory_id), _UPDATED]
            removed += int(await self._delete(keys=keys, args=["", trajectory_id]))
        return removed

    async def aclose(self) -> None:
        await self._redis.aclose()
