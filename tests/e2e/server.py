"""Start `rlserve serve` as a real process on a free loopback port (tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

# Servers started here run the tiny random model unless a test or benchmark says otherwise
# (`--model`, or RLSERVE_MODELS__MODEL in its env): the default real model is the slow tier's.
SERVER_DEFAULTS = {"RLSERVE_MODELS__MODEL": "builtin:tiny"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    url: str
    startup_seconds: float
    log: Path


class PortTaken(RuntimeError):
    """The server could not listen: another process took the free port first."""


@contextmanager
def running_server(
    *args: str, env: dict[str, str] | None = None, log: Path, ready_timeout: float = 120
) -> Iterator[Server]:
    """`rlserve serve ARGS` on a free port, ready once `/ready` answers 200. A port found free
    can be taken by another suite's process before the server binds it: then once more on
    another (three tries)."""
    with ExitStack() as stack:
        for attempt in range(3):
            port = free_port()
            command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port), *args]
            try:
                server = stack.enter_context(
                    running_process(
                        command, port, "/ready", env=env, log=log, timeout=ready_timeout
                    )
                )
                break
            except PortTaken:
                if attempt == 2:
                    raise
        yield server


@contextmanager
def serving_here(
    tmp: Path, settings: Any, *args: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """`running_server` on the test settings' model cache, its data and log under `tmp`
    (`env`: more settings)."""
    here = {
        "RLSERVE_MODELS__CACHE_DIR": str(settings.models.cache_dir),
        "RLSERVE_STORAGE__DATA_DIR": str(tmp),
    }
    with running_server(*args, env=here | (env or {}), log=tmp / "server.log") as server:
        yield server


@contextmanager
def running_process(
    command: list[str],
    port: int,
    ready_path: str,
    *,
    env: dict[str, str] | None = None,
    log: Path,
    timeout: float = 120,
) -> Iterator[Server]:
    """Any HTTP server command listening on `port`; stopped with SIGTERM on exit."""
    started = time.monotonic()
    ready_timeout = timeout
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            env={**os.environ, **SERVER_DEFAULTS, **(env or {})},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    server = Server(process, f"http://127.0.0.1:{port}", 0.0, log)
    try:
        _wait_ready(server, ready_path, started + ready_timeout)
        server.startup_seconds = time.monotonic() - started
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_ready(server: Server, ready_path: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            text = server.log.read_text()[-3000:]
            taken = "Address already in use" in text
            raise (PortTaken if taken else RuntimeError)(f"server exited early:\n{text}")
        try:
            if httpx.get(f"{server.url}{ready_path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready in time:\n{server.log.read_text()[-3000:]}")


def replicas_answering(url: str, tries: int = 40) -> set[str]:
    """The replicas (their X-RLServe-Replica) that answered `tries` GETs of /ready."""
    seen = set()
    for _ in range(tries):
        response = httpx.get(f"{url}/ready", timeout=30)
        if response.status_code == 200:
            seen.add(response.headers["x-rlserve-replica"])
    return seen


def wait_for_replicas(url: str, count: int, timeout: float = 240) -> set[str]:
    """Wait until `count` replicas behind a Ray Serve proxy answer /ready; which did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = replicas_answering(url, 10)
        if len(seen) >= count:
            return seen
        time.sleep(1)
    raise AssertionError(f"fewer than {count} replicas became ready")
