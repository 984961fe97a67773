from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.stores.redis_server import running_redis


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/system-deps.sh installs it)")
    with running_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_settings(store_kind: str, tmp_path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """Settings of a server whose stores are of the kind, empty: a fresh Redis database or
    a fresh data directory."""
    from app.config import Settings

    if store_kind == "redis":
        url = request.getfixturevalue("redis_url")
        import redis

        redis.Redis.from_url(url).flushdb()
        return Settings(storage={"data_dir": tmp_path, "session_store": url})
    return Settings(storage={"data_dir": tmp_path})


@pytest.fixture
async def stores(store_settings):  # type: ignore[no-untyped-def]
    """(session store, trajectory store) of the kind, empty; a second pair on the same data
    comes from `reopen()` (another server sharing it)."""
    from app.main import open_stores

    settings = store_settings
    opened = []

    def reopen():  # type: ignore[no-untyped-def]
        pair = open_stores(settings.storage)
        opened.append(pair)
        return pair

    yield reopen()[0], reopen
    for sessions, trajectories in opened:
        await sessions.aclose()
        await trajectories.aclose()
