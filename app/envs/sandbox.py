"""Run untrusted, model-written Python in a separate, limited process.

Limits: wall-clock timeout (the whole process group is killed), CPU time, address space,
file size and process count; a fresh temporary working directory; an environment holding only
PATH and LANG (no server variables, no API keys); stdout+stderr capped. When the server runs as
root the child drops to an unprivileged user (so the process-count limit holds and server files
are out of reach), and where the host allows it (root, or unprivileged user namespaces) it gets
a new network namespace with no interfaces up (no network). Where it cannot, the code runs with
the host's network: `SandboxResult.network_isolated` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)
UNPRIVILEGED_UID = 65534  # "nobody"


def default_interpreter() -> str:
    """A Python the unprivileged sandbox user can run: the system's, not the server's venv
    (model-written code gets no access to the server's packages either)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK) and os.stat(os.path.realpath(candidate)).st_mode & 0o001:
            return candidate
    return sys.executable


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20
    max_output_bytes: int = 16 << 10
    max_processes: int = 32
    max_file_bytes: int = 16 << 20
    interpreter: str = field(default_factory=default_interpreter)


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    network_isolated: bool

    @property
    def output(self) -> str:
        """What the tool reports, as TorchRL's PythonInterpreter does: stdout when the code
        succeeded, stderr when it failed (each stream keeps the order the program wrote it)."""
        return self.stdout if self.ok else self.stderr


CLONE_NEWNET = 0x40000000


def _new_network_namespace() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return bool(libc.unshare(CLONE_NEWNET) == 0)


def _limit(limits: SandboxLimits, isolate: bool, drop_privileges: bool) -> None:  # in the child
    if isolate and not _new_network_namespace():
        os._exit(97)  # never run without the isolation the probe promised
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.max_file_bytes, limits.max_file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if drop_privileges:
        os.setgroups([])
        os.setgid(UNPRIVILEGED_UID)
        os.setuid(UNPRIVILEGED_UID)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))


@cache
def network_isolation_available() -> bool:
    """Whether a child of this server can enter a new network namespace (probed once)."""
    available = _probe_network_namespace()
    if not available:
        logger.warning(
            "the python tool cannot create a network namespace on this host: sandboxed code "
            "runs with the host's network (all other limits still hold)"
        )
    return available


def _probe_network_namespace() -> bool:
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import app.envs.sandbox as s, sys; sys.exit(not s._new_network_namespace())",
        ],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return probe.returncode == 0


@dataclass
class _Capture:
    """Both output streams, read concurrently under one shared byte cap."""

    cap: int
    stdout: list[bytes] = field(default_factory=list)
    stderr: list[bytes] = field(default_factory=list)
    size: int = 0
    overflowed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def full(self) -> bool:
        return self.size > self.cap

    async def read(self, stream: asyncio.StreamReader, chunks: list[bytes]) -> None:
        """Read into `chunks` until EOF or until the cap is passed (kept on timeout too)."""
        while not self.full:
            chunk = await stream.read(1 << 16)
            if not chunk:
                return
            chunks.append(chunk)
            self.size += len(chunk)
        self.overflowed.set()

    async def read_both(self, stdout: asyncio.StreamReader, stderr: asyncio.StreamReader) -> None:
        """Until both streams end, or one passes the cap (the process is killed then)."""
        readers: asyncio.Future[Any] = asyncio.gather(
            self.read(stdout, self.stdout), self.read(stderr, self.stderr)
        )
        overflow: asyncio.Future[Any] = asyncio.ensure_future(self.overflowed.wait())
        try:
            await asyncio.wait([readers, overflow], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (readers, overflow):
                task.cancel()
            await asyncio.gather(readers, overflow, return_exceptions=True)

    def text(self, chunks: list[bytes], budget: int) -> tuple[str, int]:
        data = b"".join(chunks)[:budget]
        return data.decode("utf-8", errors="replace"), budget - len(data)


async def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Execute `code` with `python -I` under the limits; never raises for the code's faults."""
    limits = limits or SandboxLimits()
    isolate = network_isolation_available()
    drop = os.geteuid() == 0
    with tempfile.TemporaryDirectory(prefix="rlserve-sandbox-") as workdir:
        if drop:
            os.chown(workdir, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
        process = await asyncio.create_subprocess_exec(
            limits.interpreter,
            "-I",
            "-c",
            code,
            cwd=workdir,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            preexec_fn=lambda: _limit(limits, isolate, drop),
        )
        assert process.stdout is not None and process.stderr is not None
        timed_out = False
        capture = _Capture(limits.max_output_bytes)
        try:
            async with asyncio.timeout(limits.timeout_s):
                await capture.read_both(process.stdout, process.stderr)
                if not capture.full:
                    await process.wait()
        except TimeoutError:
            timed_out = True
        finally:
            await _kill_group(process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            # Read the pipes to their end (the writers are dead), so their transports close.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2.0):
                    for stream in (process.stdout, process.stderr):
                        while await stream.read(1 << 16):
                            pass
            await process.wait()
    exit_code = process.returncode
    ok = not timed_out and exit_code == 0 and not capture.full
    stdout, left = capture.text(capture.stdout, limits.max_output_bytes)
    stderr, _ = capture.text(capture.stderr, left)
    notes = ""
    if capture.full:
        notes += f"\n[output truncated at {limits.max_output_bytes} bytes]"
    if timed_out:
        notes += f"\n[killed: exceeded the {limits.timeout_s:g} s time limit]"
    # The notes go where the tool's message reads from: stdout on success, stderr otherwise.
    return SandboxResult(
        ok=ok,
        stdout=stdout + (notes if ok else ""),
        stderr=stderr + ("" if ok else notes),
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=capture.full,
        network_isolated=isolate,
    )


async def _kill_group(pgid: int, patience_s: float = 2.0) -> None:
    """SIGKILL the whole process group, again until it is empty (a fork bomb races the first
    signal), for at most `patience_s`."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        await asyncio.sleep(0.05)
