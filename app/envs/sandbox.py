"""Run untrusted, model-written Python isolated by bubblewrap.

Every run gets its own user, pid, mount, ipc, uts, network and cgroup namespaces (`bwrap
--unshare-all --unshare-user`): no network interface but a downed loopback, no view of any
process outside it (the server's `/proc/<pid>/environ` included), read-only system files
(`/usr` alone, with the interpreter's site-packages hidden), nothing of the server's code or
data, private size-capped tmpfs on `/tmp`, `/var/tmp` and `/dev/shm`, no capabilities, a clean
environment and a new session (no terminal injection). `--die-with-parent` and the pid
namespace tie everything the code starts to the run: when the code's main process exits, is
killed on timeout, or the server dies, every process it forked, setsid or double-forked ends.

Inside, before the code starts, a small runner sets the rlimits (CPU seconds, address space per
process, file size, open files, core dumps off, and a process count that the kernel counts per
user namespace, so per run) and closes every inherited descriptor above 2 (uvloop's subprocess
ignores `close_fds`), then execs `python -I -c <code>`. When the server runs as root, each
concurrent run also gets its own host uid (`setpriv`): runs can never signal or trace each
other, and nothing runs as root. Non-root servers (the Docker images) need unprivileged user
namespaces, which common hosts and the compose file's security options provide.

Isolation "none" is an operator's explicit, logged opt-out for hosts without user namespaces:
the same runner, limits and clean environment, but the host's network, processes and files.

Bounds: memory is bounded per process (RLIMIT_AS) times the process count, plus the tmpfs
sizes; concurrent runs are a pool (excess waits in order), so the whole sandbox holds at most
`max_concurrent` times that.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

Isolation = Literal["bwrap", "none"]
SANDBOX_UID = 1000  # the id the code sees inside its user namespace


def default_interpreter() -> str:
    """A system Python under /usr (the only tree the sandbox mounts), not the server's venv."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return sys.executable


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 << 20  # address space of each process
    max_output_bytes: int = 16 << 10
    max_processes: int = 16  # all processes of one run, its init included
    max_file_bytes: int = 16 << 20
    max_open_files: int = 256
    tmpfs_bytes: int = 64 << 20  # each of /tmp, /var/tmp, /dev/shm
    max_code_bytes: int = 64 << 10  # one block's source (it travels as one argument)
    interpreter: str = field(default_factory=default_interpreter)


@dataclass(frozen=True)
class SandboxResult:
    ok: bool
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    isolated: bool

    @property
    def output(self) -> str:
        """What the tool reports, as TorchRL's PythonInterpreter does: stdout when the code
        succeeded, stderr when it failed (each stream keeps the order the program wrote it)."""
        return self.stdout if self.ok else self.stderr


class SandboxUnavailable(RuntimeError):
    """The isolation the server is configured for does not work on this host."""


# Runs inside the sandbox as `python -I -S -c RUNNER LIMITS CODE`: the limits hold for the
# code and everything it starts; no descriptor of the server's survives into the code.
RUNNER = """
import os, resource, sys
names = ("CPU", "AS", "FSIZE", "NOFILE", "NPROC", "CORE")
for name, value in zip(names, map(int, sys.argv[1].split(","))):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
os.closerange(3, 1 << 20)
os.execv(sys.executable, [sys.executable, "-I", "-c", sys.argv[2]])
"""


class Sandbox:
    """A pool of isolated Python runs. `probe()` once (blocking: call it off the event
    loop) before `run()`; `problem` says why runs are refused, if they are."""

    def __init__(
        self,
        limits: SandboxLimits,
        isolation: Isolation = "bwrap",
        max_concurrent: int = 4,
        uid_base: int = 200_000,
    ) -> None:
        self.limits = limits
        self.isolation = isolation
        self.uid_base = uid_base
        self.problem: str | None = "the sandbox has not been probed yet"
        self._hidden: list[str] = []
        # A semaphore admits runs in arrival order (no barging); a free slot then exists.
        self._admission = asyncio.Semaphore(max_concurrent)
        self._free = list(range(max_concurrent))

    # -- start-up -----------------------------------------------------------------------

    def probe(self) -> str | None:
        """Check that a run works as configured; remember and return the problem if not."""
        self.problem = self._probe()
        if self.problem is not None:
            logger.error("the python tool is disabled: %s", self.problem)
        elif self.isolation == "none":
            logger.warning(
                "SANDBOX ISOLATION IS OFF (RLSERVE_TOOLS__ISOLATION=none): model-written code "
                "runs with the host's network, processes and files, limited by rlimits only"
            )
        return self.problem

    def _probe(self) -> str | None:
        if self.isolation == "bwrap" and shutil.which("bwrap") is None:
            return (
                "bubblewrap (bwrap) is not installed; install it, "
                "or set RLSERVE_TOOLS__ISOLATION=none"
            )
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            return "setpriv (util-linux) is needed to run the tool as a non-root user"
        try:
            self._hidden = self._site_directories()
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"the interpreter {self.limits.interpreter} does not run: {error}"
        argv = self._argv("import os; print(os.getpid())", slot=0, timeout_s=30)
        try:
            done = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"a test run failed: {error}"
        output = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0:
            detail = done.stderr.decode(errors="replace").strip()[-300:]
            hint = (
                " (unprivileged user namespaces may be off: see the python tool sandbox in"
                " docs/guides/environments.md)"
                if self.isolation == "bwrap"
                else ""
            )
            return f"a test run exited with {done.returncode}: {detail}{hint}"
        if self.isolation == "bwrap" and output != "2":
            return f"a test run did not get its own pid namespace (pid {output})"
        return None

    def _site_directories(self) -> list[str]:
        """The interpreter's package directories, hidden under empty tmpfs in the sandbox
        (a server installed into the system Python would otherwise be readable there)."""
        code = "import site, sys; print('\\n'.join(site.getsitepackages()))"
        done = subprocess.run(
            [self.limits.interpreter, "-I", "-c", code],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return [d for d in done.stdout.decode().split() if os.path.isdir(d)]

    # -- runs ---------------------------------------------------------------------------

    async def run(self, code: str, deadline: float | None = None) -> SandboxResult:
        """Execute `code` under the limits, ending by `deadline` (a `loop.time()`) if given;
        waits for a free slot first (the wait counts against the deadline). Never raises for
        the code's faults; raises SandboxUnavailable when runs are refused. Cancelling it
        kills the run."""
        if self.problem is not None:
            raise SandboxUnavailable(self.problem)
        if len(code.encode("utf-8", "surrogatepass")) > self.limits.max_code_bytes:
            return _refused(f"code block exceeds {self.limits.max_code_bytes} bytes", self)
        async with self._slot() as slot:
            timeout = self.limits.timeout_s
            if deadline is not None:
                timeout = min(timeout, deadline - asyncio.get_running_loop().time())
            if timeout <= 0:
                return _refused("the time budget was spent before it could start", self)
            return await self._run(code, slot, timeout)

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[int]:
        async with self._admission:
            slot = self._free.pop()
            try:
                yield slot
            finally:
                self._free.append(slot)

    async def _run(self, code: str, slot: int, timeout_s: float) -> SandboxResult:
        limits = self.limits
        process = await asyncio.create_subprocess_exec(
            *self._argv(code, slot, timeout_s),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
        assert process.stdout is not None and process.stderr is not None
        timed_out = False
        capture = _Capture(limits.max_output_bytes)
        try:
            async with asyncio.timeout(timeout_s):
                await capture.read_both(process.stdout, process.stderr)
                if not capture.full:
                    await process.wait()
        except TimeoutError:
            timed_out = True
        finally:
            # Killing bwrap ends its pid namespace (--die-with-parent), and with it every
            # process the code started; the group kill covers isolation "none".
            await _kill_group(process.pid)
            with contextlib.suppress(ProcessLookupError):
                process.kill()
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
            notes += f"\n[killed: exceeded the {timeout_s:g} s time limit]"
        # The notes go where the tool's message reads from: stdout on success, stderr otherwise.
        return SandboxResult(
            ok=ok,
            stdout=stdout + (notes if ok else ""),
            stderr=stderr + ("" if ok else notes),
            exit_code=exit_code,
            timed_out=timed_out,
            truncated=capture.full,
            isolated=self.isolation == "bwrap",
        )

    def _argv(self, code: str, slot: int, timeout_s: float) -> list[str]:
        limits = self.limits
        cpu = max(1, min(limits.cpu_seconds, int(timeout_s) + 1))
        values = (
            cpu,
            limits.memory_bytes,
            limits.max_file_bytes,
            limits.max_open_files,
            limits.max_processes,
            0,
        )
        python = [limits.interpreter, "-I", "-S", "-c", RUNNER, ",".join(map(str, values)), code]
        argv = [*self._bwrap(), "--", *python] if self.isolation == "bwrap" else python
        if os.geteuid() == 0:  # one host uid per concurrent run, never root
            uid = str(self.uid_base + slot)
            argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]
        return argv

    def _bwrap(self) -> list[str]:
        size = str(self.limits.tmpfs_bytes)
        argv = [
            "bwrap",
            "--die-with-parent",
            "--new-session",
            "--unshare-all",
            "--unshare-user",
            "--uid",
            str(SANDBOX_UID),
            "--gid",
            str(SANDBOX_UID),
            "--hostname",
            "sandbox",
            "--cap-drop",
            "ALL",
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin:/bin",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--setenv",
            "HOME",
            "/tmp",
            "--ro-bind",
            "/usr",
            "/usr",
        ]
        for top in ("bin", "lib", "lib32", "lib64", "sbin"):
            path = f"/{top}"
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        argv += ["--proc", "/proc", "--dev", "/dev"]
        for private in ("/tmp", "/var/tmp", "/dev/shm"):
            argv += ["--size", size, "--tmpfs", private]
        for hidden in self._hidden:
            argv += ["--size", "4096", "--tmpfs", hidden, "--remount-ro", hidden]
        argv += ["--chdir", "/tmp"]
        return argv


def _refused(reason: str, sandbox: Sandbox) -> SandboxResult:
    return SandboxResult(
        ok=False,
        stdout="",
        stderr=f"[not run: {reason}]",
        exit_code=None,
        timed_out=False,
        truncated=False,
        isolated=sandbox.isolation == "bwrap",
    )


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
