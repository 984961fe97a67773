"""The routes of SGLang's router (sgl-model-gateway, and the sgl-router before it) that a
trainer calls at its router address, for a trainer given rlserve as that address (slime's
`--sglang-router-ip/--sglang-router-port`): rlserve is a router of one worker, itself. It
lists itself as its one worker (slime's `abort()` reads `workers[i].url`, then aborts each
worker and polls its `/v1/loads`), and takes a registration of its own address (slime posts
each engine it uses, this one too); it routes to no other server, so another address is
refused."""

from __future__ import annotations

import uuid
from urllib.parse import urlsplit

from fastapi import APIRouter, Request

from app.common.failures import invalid
from app.deps import RegistryDep
from app.dialects.sglang.protocol import (
    RegisterWorker,
    WorkerInfo,
    WorkerRegistered,
    Workers,
    WorkerStats,
    WorkerUrls,
)
from app.engine.registry import ModelRegistry
from app.errors import ERROR_RESPONSES
from app.ops.access import Access, access

router = APIRouter(tags=["SGLang dialect"], responses=ERROR_RESPONSES)


def own_url(request: Request) -> str:
    """This server's address as the caller reached it (scheme, host and port)."""
    base = request.base_url
    return f"{base.scheme}://{base.netloc}".rstrip("/")


def worker_id(url: str) -> str:
    """The worker's id (a UUID, as the gateway gives its workers), the same for one address."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, url))


def _worker(registry: ModelRegistry, url: str) -> WorkerInfo:
    state = registry.gate.state()
    names = [alias for alias, target in registry.aliases.items() if target == "policy"]
    return WorkerInfo(
        id=worker_id(url),
        url=url,
        model_id=names[0] if names else "policy",
        is_healthy=registry.not_ready_reason() is None,
        load=state.in_flight_generations + state.in_flight_scoring + state.waiting,
    )


@router.get("/workers", response_model=Workers, summary="Workers (SGLang's router)")
async def workers(request: Request, registry: RegistryDep) -> Workers:
    """The router's workers: this server alone, at the address the caller reached it by."""
    worker = _worker(registry, own_url(request))
    return Workers(workers=[worker], total=1, stats=WorkerStats(regular_count=1))


@router.get("/list_workers", response_model=WorkerUrls, summary="Worker URLs (older router)")
async def list_workers(request: Request) -> WorkerUrls:
    """The sgl-router's older form (slime before v0.3.1 with sglang_router 0.2.1 or older)."""
    return WorkerUrls(urls=[own_url(request)])


@router.post(
    "/workers",
    response_model=WorkerRegistered,
    summary="Register a worker (SGLang's router)",
    openapi_extra=access(Access.ADMIN),
)
async def register_worker(body: RegisterWorker, request: Request) -> WorkerRegistered:
    """Taken, again and again, for this server's own address (a trainer registers each
    engine it uses at every start); any other address is refused: rlserve serves every
    request itself and routes to no other server."""
    own = own_url(request)
    if not _names_this_server(body.url, request):
        raise invalid(
            "url",
            f"'{body.url}' is not this server ({own}): rlserve answers every request itself and "
            "routes to no other server; give the trainer rlserve's own address as its engine",
        )
    return WorkerRegistered(
        worker_id=worker_id(own),
        url=body.url,
        location=f"/workers/{worker_id(own)}",
        message="rlserve serves every request itself; this address is its one worker",
    )


def _names_this_server(url: str, request: Request) -> bool:
    """Whether `url` reaches the port this request came in on (under any of the host's
    names: 127.0.0.1, localhost, its address on the network)."""
    try:
        given = urlsplit(url if "://" in url else f"http://{url}")
        port = given.port or (443 if given.scheme == "https" else 80)
    except ValueError:
        return False
    own = request.base_url
    return port == (own.port or (443 if own.scheme == "https" else 80))
