"""Both session stores (SQLite, Redis) keep one contract: sessions by owner, compare-and-set
writes, expiry; trajectories appended with consecutive turns from any number of servers."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from app.envs.store import SessionRecord
from app.trajectories.store import TURNS_FULL, Turn


def turn(i: int) -> Turn:
    return Turn([1, 2], [i], [-0.5], [[0, 0, 1]], "stop", "policy", float(i))


async def test_sessions_compare_and_set(stores):
    sessions, reopen = stores
    other, _ = reopen()  # a second server on the same store
    await sessions.put(SessionRecord("env-a", {"k": 1}, {"s": 0}, 1.0, 1.0, owner="alice"))
    mine, theirs = await sessions.get("env-a"), await other.get("env-a")
    assert mine is not None and theirs is not None and mine.revision == theirs.revision == 0
    mine.state = {"s": 1}
    assert await sessions.replace(mine) and mine.revision == 1
    theirs.state = {"s": 2}
    assert not await other.replace(theirs)  # written over a revision that is gone
    stored = await other.get("env-a")
    assert stored is not None and stored.state == {"s": 1} and stored.revision == 1
    assert stored.config == {"k": 1} and stored.owner == "alice"
    assert not await sessions.replace(SessionRecord("env-missing", {}, {}, 1.0, 1.0))


async def test_sessions_by_owner_and_expiry(stores):
    sessions, _ = stores
    for i in range(5):
        owner = "alice" if i < 3 else "bob"
        await sessions.put(SessionRecord(f"env-{i}", {}, {}, float(i), float(10 + i), owner))
    page, total = await sessions.page("alice", 1, 10)
    assert [r.env_id for r in page] == ["env-1", "env-2"] and total == 3
    assert await sessions.count() == 5 and await sessions.count("bob") == 2
    assert sorted(await sessions.expire(12.0)) == ["env-0", "env-1"]
    assert await sessions.count() == 3 and await sessions.count("alice") == 1
    assert await sessions.delete("env-4") and not await sessions.delete("env-4")
    assert await sessions.get("env-4") is None and await sessions.count("bob") == 1


async def test_trajectory_turns_are_consecutive_across_servers(stores):
    _, reopen = stores
    servers = [reopen()[1] for _ in range(3)]
    indices = await asyncio.gather(
        *(servers[i % 3].append("t-1", "alice", turn(i), 100) for i in range(12))
    )
    assert sorted(indices) == list(range(12))
    found = await servers[0].get("t-1", "alice")
    assert found is not None and found.owner == "alice" and len(found.turns) == 12
    assert sorted(t.completion_ids[0] for t in found.turns) == list(range(12))
    assert await servers[2].head("t-1", "alice") == 12
    assert await servers[2].head("t-2", "alice") is None
    assert await servers[1].append("t-1", "alice", turn(0), 12) == TURNS_FULL
    # ids are per owner: bob's "t-1" is another trajectory, and alice's is not his
    assert await servers[2].head("t-1", "bob") is None
    assert await servers[1].append("t-1", "bob", turn(0), 100) == 0
    assert not await servers[2].set_reward("t-2", "bob", 1.0)
    assert await servers[2].set_reward("t-1", "alice", 0.5)
    found, bobs = await servers[1].get("t-1", "alice"), await servers[1].get("t-1", "bob")
    assert found is not None and found.reward == 0.5 and len(found.turns) == 12
    assert bobs is not None and bobs.reward is None and len(bobs.turns) == 1
    assert await servers[0].delete("t-1", "bob") and not await servers[0].delete("t-1", "bob")
    assert await servers[0].delete("t-1", "alice") and await servers[0].get("t-1", "alice") is None


async def test_each_owners_stored_bytes_are_counted(stores):
    """Appends add each turn's record as stored, deletes and expiry take it off again, on
    every server sharing the store."""
    _, reopen = stores
    one, two = reopen()[1], reopen()[1]
    size = len(json.dumps(dataclasses.asdict(turn(1))))
    for i in range(3):
        await (one if i % 2 else two).append("a", "alice", turn(1), 10)
    await one.append("b", "alice", turn(1), 10)
    await two.append("a", "bob", turn(1), 10)
    assert await two.usage("alice") == 4 * size and await one.usage("bob") == size
    assert await one.usage("carol") == 0
    assert await two.delete("a", "alice") and await one.usage("alice") == size
    assert await one.expire(float("inf")) == 2
    assert await two.usage("alice") == 0 and await two.usage("bob") == 0


async def test_idle_trajectories_expire(stores):
    _, reopen = stores
    trajectories = reopen()[1]
    await trajectories.append("old", "", turn(0), 10)
    assert await trajectories.expire(0.0) == 0
    assert await trajectories.expire(float("inf")) == 1
    assert await trajectories.get("old", "") is None


async def test_datasets_by_owner_unique_names_and_quota(store_settings):
    """Uploaded datasets live beside the sessions: two servers on one store see the same ones;
    a name is taken once per owner, even by two servers at once; the quota holds."""
    from app.datasets.store import DatasetExists, DatasetMeta, TooManyDatasets
    from app.main import open_dataset_store

    settings = store_settings
    one, two = open_dataset_store(settings.storage), open_dataset_store(settings.storage)

    def meta(name: str, owner: str = "alice") -> DatasetMeta:
        return DatasetMeta(name, owner, 1, 10, ["kwargs"], 1.0)

    try:
        results = await asyncio.gather(
            one.create(meta("a"), '[["q", null, {}]]', 2),
            two.create(meta("a"), '[["q", null, {}]]', 2),
            return_exceptions=True,
        )
        assert sorted(type(r).__name__ for r in results) == ["DatasetExists", "NoneType"]
        await two.create(meta("a", owner="bob"), '[["theirs", null, {}]]', 2)
        assert await one.rows("alice", "a") == '[["q", null, {}]]'
        assert await one.rows("bob", "a") == '[["theirs", null, {}]]'
        await one.create(meta("b"), "[]", 2)
        with pytest.raises(TooManyDatasets):
            await two.create(meta("c"), "[]", 2)
        with pytest.raises(DatasetExists):
            await two.create(meta("b"), "[]", 5)
        assert [m.name for m in await two.list("alice")] == ["a", "b"]
        assert await two.meta("alice", "b") == meta("b")
        assert await one.delete("alice", "a") and not await two.delete("alice", "a")
        assert await two.meta("alice", "a") is None and await two.rows("alice", "a") is None
        assert [m.name for m in await one.list("bob")] == ["a"]
    finally:
        await one.aclose()
        await two.aclose()
