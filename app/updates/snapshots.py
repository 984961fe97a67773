"""Published snapshots (the hot-load vocabulary of hosted trainers): an identity, and a whole
checkpoint or a delta chained to the previous identity, at a path or an HTTP(S) URL (an object
store's presigned URL is one; no cloud SDK). It is fetched, checked and staged while serving
goes on (a delta against the served weights tensor by tensor, the digest the publisher names
before anything is written), then committed under the usual pause; one that fails any check
leaves the current snapshot served. `Loads` keeps where each model's last load stands, which
the replicas report (`WeightsControl.served`)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import httpx

from app.common.failures import Conflict, Failure, NotFound, PeerFailed, invalid, recast
from app.common.roles import Role
from app.engine.registry import ModelRegistry
from app.updates.control import WeightsControl
from app.updates.service import WeightsService
from app.updates.types import Applied, Publish, ServedWeights, SnapshotAsk, Streamed

FETCH_CHUNK = 1 << 20


@dataclass
class _Load:
    stage: Literal["serving", "fetching", "loading"] = "serving"
    last_error: Failure | str | None = None
    since: float = 0.0


class Loads:
    """Where each model's snapshot load on this server stands."""

    def __init__(self) -> None:
        self._loads: dict[str, _Load] = {}

    def served(self, registry: ModelRegistry, model: str, replica: str | None) -> ServedWeights:
        load = self._loads.get(model, _Load())
        return ServedWeights(
            model=model,
            version=registry.versions.get(model, 0),
            digest=registry.digests.of(model),
            snapshot=registry.snapshots.get(model),
            stage=load.stage,
            last_error=load.last_error,
            replica=replica,
        )

    @contextlib.contextmanager
    def tracked(self, model: str) -> Iterator[_Load]:
        load = self._loads.setdefault(model, _Load())
        if load.stage != "serving":
            raise Conflict(
                f"a snapshot of '{model}' is being loaded already (since "
                f"{time.time() - load.since:.0f} s ago)",
                role=Role.MODEL,
            )
        load.stage, load.since = "fetching", time.time()
        try:
            yield load
        except Failure as exc:
            load.last_error = exc  # (each route words its role)
            raise
        except Exception as exc:
            load.last_error = f"{type(exc).__name__}: {exc}"
            raise
        else:
            load.last_error = None
        finally:
            load.stage = "serving"


async def load_snapshot(
    control: WeightsControl, files: WeightsService, loads: Loads, ask: SnapshotAsk
) -> Applied:
    """Serve snapshot `ask` through `control` (every replica, on a deployment)."""
    registry = files.registry
    registry.weights(ask.model)  # (an unknown model is refused first)
    with loads.tracked(ask.model) as load:
        current = registry.snapshots.get(ask.model)
        if ask.base is not None and ask.base != current:
            raise Conflict(
                f"snapshot '{ask.identity}' builds on '{ask.base}', but "
                f"{repr(current) if current else 'no snapshot'} is served",
                role=Role.SNAPSHOT_BASE,
            )
        async with _fetched(files, ask.source) as path:
            delta = await files.delta_file(path, Role.SNAPSHOT_SOURCE) is not None
            if delta and ask.base is None:
                raise invalid(
                    Role.SNAPSHOT_BASE, "a delta snapshot names the snapshot it builds on"
                )
            load.stage = "loading"
            publish = Publish(
                pause=ask.pause, snapshot=ask.identity, cache=ask.cache, expect_digest=ask.digest
            )
            return await control.load(str(path), ask.model, publish, role=Role.SNAPSHOT_SOURCE)


@contextlib.asynccontextmanager
async def _fetched(files: WeightsService, source: str) -> AsyncIterator[Path]:
    """`source` as a path the server reads: itself, or a URL's file downloaded (gone after)."""
    if not source.startswith(("http://", "https://")):
        yield Path(source)
        return
    timeout = httpx.Timeout(files.settings.io_timeout_s, connect=30)
    try:
        async with (
            httpx.AsyncClient(timeout=timeout, follow_redirects=True) as http,
            http.stream("GET", source) as response,
        ):
            if response.status_code == 404:
                raise NotFound(f"nothing at {_shown(source)} (404)", role=Role.SNAPSHOT_SOURCE)
            if response.status_code >= 400:
                raise PeerFailed(
                    f"{_shown(source)} answered {response.status_code}", role=Role.SNAPSHOT_SOURCE
                )
            declared = response.headers.get("content-length")
            size = int(declared) if declared and declared.isdigit() else None
            chunks = response.aiter_bytes(FETCH_CHUNK)
            with recast({Role.UPLOAD: Role.SNAPSHOT_SOURCE}):
                async with files.received(Streamed(chunks, size), files.upload_limit()) as path:
                    yield path
    except httpx.HTTPError as exc:
        reason = type(exc).__name__  # (its text may repeat the URL, signature and all)
        raise PeerFailed(
            f"fetching {_shown(source)} failed ({reason})", role=Role.SNAPSHOT_SOURCE
        ) from None


def _shown(url: str) -> str:
    """A URL without its query (a presigned URL's signature stays out of messages)."""
    return url.split("?", 1)[0]
