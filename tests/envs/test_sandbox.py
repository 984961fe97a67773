"""The python tool's sandbox holds against hostile code, and the server keeps answering."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import pytest

from app.envs.sandbox import SandboxLimits, network_isolation_available, run_python

LIMITS = SandboxLimits(timeout_s=3.0, cpu_seconds=3, memory_bytes=256 << 20, max_output_bytes=1000)


async def test_plain_code_runs():
    result = await run_python("print(sum(range(10)))", LIMITS)
    assert result.ok and result.output == "45\n"


async def test_errors_are_reported_not_raised():
    result = await run_python("1/0", LIMITS)
    assert not result.ok
    assert "ZeroDivisionError" in result.output


async def test_infinite_loop_is_stopped_within_the_timeout():
    start = time.monotonic()
    result = await run_python("while True:\n    pass", LIMITS)
    assert time.monotonic() - start < LIMITS.timeout_s + 2
    assert not result.ok
    assert result.timed_out or result.exit_code != 0


async def test_memory_bomb_is_stopped():
    result = await run_python("x = bytearray(2 << 30)\nprint('allocated')", LIMITS)
    assert not result.ok
    assert "allocated" not in result.output
    assert "MemoryError" in result.output


async def test_server_environment_is_not_visible(monkeypatch):
    monkeypatch.setenv("RLSERVE_API_KEYS", "secret-key-123")
    code = "import os\nprint(os.environ.get('RLSERVE_API_KEYS'))\nprint(sorted(os.environ))"
    result = await run_python(code, LIMITS)
    assert result.ok
    assert "secret-key-123" not in result.output
    assert result.output.splitlines()[0] == "None"


async def test_huge_print_is_truncated():
    result = await run_python("print('x' * 10_000_000)", LIMITS)
    assert result.truncated and not result.ok
    assert result.stdout == "x" * 1000
    assert result.output == "\n[output truncated at 1000 bytes]"


async def test_streams_keep_their_own_order_and_failures_report_stderr():
    code = "import sys\nprint('out 1')\nprint('err 1', file=sys.stderr)\nprint('out 2')\n"
    ok = await run_python(code, LIMITS)
    assert ok.ok
    assert (ok.stdout, ok.stderr, ok.output) == ("out 1\nout 2\n", "err 1\n", "out 1\nout 2\n")
    failed = await run_python(code + "raise SystemExit('bad')", LIMITS)
    assert not failed.ok and failed.exit_code == 1
    assert failed.output == "err 1\nbad\n"
    assert failed.stdout == "out 1\nout 2\n"


async def test_fork_bomb_is_contained():
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    start = time.monotonic()
    result = await run_python(code, LIMITS)
    assert not result.ok
    assert time.monotonic() - start < LIMITS.timeout_s + 5
    # Nothing of it survives: no process of the sandbox user is left running.
    for _ in range(50):
        if not _running_as_nobody():
            break
        await asyncio.sleep(0.1)
    assert _running_as_nobody() == []


def _running_as_nobody() -> list[str]:
    """Live (not zombie) processes of the sandbox user."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid != 65534:
                continue
            with open(f"/proc/{pid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            found.append(pid)
    return found


async def test_files_stay_in_a_fresh_working_directory():
    first = await run_python(
        "open('note.txt', 'w').write('hi')\nimport os\nprint(os.getcwd())", LIMITS
    )
    second = await run_python("import os\nprint(os.listdir('.'))", LIMITS)
    assert first.ok and second.ok
    assert second.output.strip() == "[]"
    assert not os.path.exists(first.output.strip())


@pytest.mark.skipif(not network_isolation_available(), reason="no network namespaces on this host")
async def test_no_network():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\ns = socket.socket()\ns.settimeout(1)\n"
            f"print(s.connect_ex(('127.0.0.1', {port})))"
        )
        result = await run_python(code, LIMITS)
    assert result.network_isolated
    assert result.output.strip() != "0"
