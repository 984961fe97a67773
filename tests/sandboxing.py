"""Helpers for the tests of the python tool's sandbox: whether isolation works here, code that
leaves a marked process behind, and a scan of the host's processes for it."""

from __future__ import annotations

import os
from functools import cache

import pytest

from app.envs.sandbox import Sandbox, SandboxLimits


@cache
def isolation_problem() -> str | None:
    """Why bubblewrap isolation does not work on this host, if it does not (probed once)."""
    return Sandbox(SandboxLimits()).probe()


# CI installs bubblewrap (scripts/system-deps.sh): there the sandbox tests never skip.
needs_isolation = pytest.mark.skipif(
    isolation_problem() is not None and os.environ.get("CI") != "true",
    reason=f"no bubblewrap isolation here: {isolation_problem()}",
)


def sleep_argv(marker: str, seconds: int = 60) -> str:
    """The argv (python source) of a long sleep whose command line carries `marker`."""
    return f"[sys.executable, '-c', 'import time; time.sleep({seconds})', '{marker}']"


def sleeper(marker: str, seconds: int = 60) -> str:
    """Code that becomes a long sleep whose command line carries `marker`."""
    return f"import os, sys\nos.execv(sys.executable, {sleep_argv(marker, seconds)})"


def escaper(marker: str, seconds: int = 60) -> str:
    """Code that leaves a marked sleep behind the way escapes do: in a new session (setsid),
    two forks away, its parent gone. Code appended to it runs in the original process."""
    return (
        "import os, sys\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv(sys.executable, {sleep_argv(marker, seconds)})\n"
        "    os._exit(0)\n"
    )


def host_processes_with(marker: str) -> list[int]:
    """Live (not zombie) host processes whose command line holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if marker.encode() not in cmdline.read():
                    continue
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(pid))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found
