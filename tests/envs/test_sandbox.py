"""The python tool's sandbox holds against hostile code: each attack that got through the old
rlimit-only sandbox is tried here against bubblewrap isolation, from inside a run."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest

from app.envs.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from tests.sandboxing import escaper, host_processes_with, needs_isolation, sleep_argv, sleeper

LIMITS = SandboxLimits(
    timeout_s=3.0, cpu_seconds=3, memory_bytes=256 << 20, max_output_bytes=1000, max_processes=8
)


def _sandbox(**options: object) -> Sandbox:
    sandbox = Sandbox(LIMITS, **options)  # type: ignore[arg-type]
    sandbox.probe()
    return sandbox


ISOLATED = _sandbox()
pytestmark = needs_isolation


async def run(code: str, sandbox: Sandbox = ISOLATED) -> str:
    result = await sandbox.run(code)
    assert result.isolated == (sandbox.isolation == "bwrap")
    return result.output


async def test_plain_code_runs_and_failures_report_stderr() -> None:
    result = await ISOLATED.run("print(sum(range(10)))")
    assert result.ok and result.output == "45\n"
    code = "import sys\nprint('out 1')\nprint('err 1', file=sys.stderr)\nprint('out 2')\n"
    ok = await ISOLATED.run(code)
    assert (ok.stdout, ok.stderr, ok.output) == ("out 1\nout 2\n", "err 1\n", "out 1\nout 2\n")
    failed = await ISOLATED.run(code + "raise SystemExit('bad')")
    assert not failed.ok and failed.exit_code == 1 and failed.output == "err 1\nbad\n"
    zero = await ISOLATED.run("1/0")
    assert not zero.ok and 'File "<string>", line 1' in zero.output
    assert "ZeroDivisionError" in zero.output


async def test_loops_memory_bombs_and_floods_are_stopped() -> None:
    start = time.monotonic()
    loop = await ISOLATED.run("while True:\n    pass")
    assert not loop.ok and time.monotonic() - start < LIMITS.timeout_s + 2
    bomb = await ISOLATED.run("x = bytearray(2 << 30)\nprint('allocated')")
    assert not bomb.ok and "MemoryError" in bomb.output
    flood = await ISOLATED.run("print('x' * 10_000_000)")
    assert flood.truncated and flood.stdout == "x" * 1000
    assert flood.output == "\n[output truncated at 1000 bytes]"


async def test_the_server_is_invisible_no_environ_no_process_no_keys(monkeypatch) -> None:
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "secret-key-123")
    code = """
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
print(pids, os.getpid(), os.getppid())
leaked = []
for pid in pids:
    try:
        leaked.append(open(f'/proc/{pid}/environ', 'rb').read())
    except OSError:
        pass
print(b'secret-key-123' in b''.join(leaked), dict(os.environ).get('RLSERVE_AUTH__API_KEYS'))
try:
    os.kill(SERVER, 9)
    print('killed')
except OSError as error:
    print(type(error).__name__)
""".replace("SERVER", str(os.getpid()))
    out = (await run(code)).splitlines()
    assert out[0] == "[1, 2] 2 1"  # bwrap's init and the code: nothing else exists
    assert out[1] == "False None"
    assert out[2] == "ProcessLookupError"  # the server's pid means nothing in there


async def test_setsid_and_double_forks_end_with_the_run() -> None:
    marker = f"rlserve-escape-{uuid.uuid4().hex}"
    code = escaper(marker) + (
        "import subprocess\n"
        f"subprocess.Popen({sleep_argv(marker)}, start_new_session=True)\n"
        "print('started')\n"
    )
    assert (await run(code)) == "started\n"
    for _ in range(40):
        if not host_processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert host_processes_with(marker) == []


async def test_timeout_kills_the_whole_tree() -> None:
    marker = f"rlserve-tree-{uuid.uuid4().hex}"
    code = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])
time.sleep(60)
"""
    result = await ISOLATED.run(code, deadline=asyncio.get_running_loop().time() + 1.0)
    assert result.timed_out
    await asyncio.sleep(0.2)
    assert host_processes_with(marker) == []


async def test_cancelling_a_run_kills_it() -> None:
    marker = f"rlserve-cancel-{uuid.uuid4().hex}"
    code = sleeper(marker)
    task = asyncio.create_task(ISOLATED.run(code))
    for _ in range(100):
        if host_processes_with(marker):
            break
        await asyncio.sleep(0.05)
    assert host_processes_with(marker)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)
    assert host_processes_with(marker) == []


async def test_private_tmp_dev_shm_and_no_server_files() -> None:
    marker = uuid.uuid4().hex
    write = f"""
import os
for d in ('/tmp', '/var/tmp', '/dev/shm'):
    open(os.path.join(d, '{marker}'), 'w').write('x')
print(sorted(os.listdir('/')))
"""
    top = (await run(write)).strip()
    assert "'work'" not in top and "'root'" not in top and "'home'" not in top
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        assert not os.path.exists(os.path.join(directory, marker))
    places = "('/tmp', '/var/tmp', '/dev/shm')"
    again = f"import os\nprint([os.path.exists(d + '/{marker}') for d in {places}])"
    assert (await run(again)).strip() == "[False, False, False]"
    here = os.path.dirname(os.path.abspath(__file__))
    assert (await run(f"import os\nprint(os.path.exists({here!r}))")).strip() == "False"
    # /usr is read-only and the interpreter's site-packages are empty.
    ro = (
        "import os, site\nfor d in site.getsitepackages():\n"
        "    print(os.listdir(d) if os.path.isdir(d) else [])\nopen('/usr/x', 'w')"
    )
    out = await ISOLATED.run(ro)
    assert not out.ok and "Read-only file system" in out.output
    assert set(out.stdout.split()) <= {"[]"}


async def test_tmpfs_is_size_capped() -> None:
    # Files under the 16 MB file-size limit, until the 64 MB tmpfs is full.
    code = "for i in range(20):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (10 << 20))"
    assert "No space left on device" in await run(code)


async def test_no_descriptor_of_the_server_is_inherited() -> None:
    with tempfile.NamedTemporaryFile() as secret:
        os.set_inheritable(secret.fileno(), True)  # as if the spawner ignored close_fds
        out = await run("import os\nprint(sorted(os.listdir('/proc/self/fd')))")
    assert out.strip() == "['0', '1', '2', '3']"  # 3: the directory listing itself


async def test_no_network() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\ns = socket.socket()\ns.settimeout(1)\n"
            f"print(s.connect_ex(('127.0.0.1', {port})))\n"
            "print(sorted(i[1] for i in socket.if_nameindex()))"
        )
        out = (await run(code)).splitlines()
    assert out[0] != "0"
    assert out[1] == "['lo']"


async def test_fork_bombs_are_bounded_per_run_and_spare_other_runs() -> None:
    bomb = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n        n += 1\n    except OSError:\n"
        "        break\nprint(n)"
    )
    other = "import os\nif os.fork() == 0:\n    os._exit(0)\nprint('forked')"
    bombed, spared = await asyncio.gather(ISOLATED.run(bomb), ISOLATED.run(other))
    # 8 processes per run, bwrap's init and the code included.
    assert bombed.ok and int(bombed.output) == LIMITS.max_processes - 2
    assert spared.ok and spared.output.strip() == "forked"


async def test_concurrent_runs_cannot_see_each_other() -> None:
    marker = uuid.uuid4().hex
    holder = f"import time\nsecret = '{marker}'\ntime.sleep(2)"
    spy = (
        "import os, time\ntime.sleep(0.5)\nseen = []\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        "    seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
        f"print(b'{marker[:16]}' + b'{marker[16:]}' in b''.join(seen), len(seen))"
    )
    _, spied = await asyncio.gather(ISOLATED.run(holder), ISOLATED.run(spy))
    assert spied.output.strip() == "False 2"


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run host uids apply to a root server")
async def test_runs_of_a_root_server_use_a_host_uid_per_slot() -> None:
    marker = uuid.uuid4().hex
    code = f"import time\ntime.sleep(1.5) or '{marker}'"
    tasks = [asyncio.create_task(ISOLATED.run(code)) for _ in range(2)]
    await asyncio.sleep(0.8)
    uids = {os.stat(f"/proc/{pid}").st_uid for pid in host_processes_with(marker)}
    await asyncio.gather(*tasks)
    assert len(uids) == 2 and 0 not in uids
    assert uids <= {ISOLATED.uid_base + slot for slot in range(4)}


async def test_the_pool_bounds_concurrent_runs() -> None:
    pool = _sandbox(max_concurrent=2)
    start = time.monotonic()
    await asyncio.gather(*(pool.run("import time\ntime.sleep(1)") for _ in range(4)))
    assert time.monotonic() - start >= 2.0  # two waves of two


async def test_oversized_code_is_refused_unrun() -> None:
    result = await ISOLATED.run("x = 1\n" * (LIMITS.max_code_bytes // 6 + 1))
    assert not result.ok and result.exit_code is None
    assert result.output == f"[not run: code block exceeds {LIMITS.max_code_bytes} bytes]"


def test_a_missing_isolation_tool_refuses_runs(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox = _sandbox()
    assert sandbox.problem is not None and "bubblewrap" in sandbox.problem
    with pytest.raises(SandboxUnavailable):
        asyncio.run(sandbox.run("print(1)"))


@pytest.fixture
def unisolated() -> Iterator[Sandbox]:
    yield _sandbox(isolation="none")


async def test_the_explicit_opt_out_still_limits_and_cleans(unisolated: Sandbox) -> None:
    assert unisolated.problem is None
    result = await unisolated.run(
        "import os\nprint(os.environ.get('HOME'), len(os.listdir('/proc/self/fd')))"
    )
    assert result.ok and not result.isolated
    bomb = await unisolated.run("x = bytearray(2 << 30)")
    assert "MemoryError" in bomb.output


def test_a_missing_interpreter_is_a_reason_not_a_crash() -> None:
    sandbox = Sandbox(SandboxLimits(interpreter="/nonexistent/python3"))
    problem = sandbox.probe()
    assert problem is not None and "/nonexistent/python3" in problem
