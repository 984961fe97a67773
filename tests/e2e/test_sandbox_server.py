"""The deployment we ship: a server running as a non-root user (as both Docker images run it),
attacked through the python tool by model-written code. Each attack here got through before
the tool ran under bubblewrap: reading the API keys from the server's /proc environ, calling
the API, rewriting the session store, killing the server, leaving processes behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import Server, free_port, running_process
from tests.sandboxing import escaper, host_processes_with, isolation_problem, sleeper

UNPRIVILEGED = 65534
USER_KEY, ADMIN_KEY = "user-secret-8d1f", "admin-secret-77c2"
HEADERS = {"Authorization": f"Bearer {USER_KEY}"}
REPO = Path(__file__).resolve().parents[2]


def _unprivileged_can_run_the_server() -> str | None:
    """Why this host cannot run the server as an unprivileged user, if it cannot."""
    problem = isolation_problem()
    if problem is not None and os.environ.get("CI") != "true":  # CI installs bubblewrap
        return f"no bubblewrap isolation here: {problem}"
    if os.geteuid() != 0:
        return None  # this test process is already the non-root server's user
    for path in (REPO, Path(sys.executable).resolve().parent):
        if not os.access(path, os.R_OK | os.X_OK) or (os.stat(path).st_mode & 0o005) != 0o005:
            return f"{path} is not readable by an unprivileged user"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif((why := _unprivileged_can_run_the_server()) is not None, reason=why or ""),
]


def _owned_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, UNPRIVILEGED, UNPRIVILEGED)
    return path


@pytest.fixture
def home() -> Iterator[Path]:
    """A directory the unprivileged user can reach (pytest's tmp_path sits under a 0700 one)."""
    path = Path(tempfile.mkdtemp(prefix="rlserve-unprivileged-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def server(home: Path) -> Iterator[Server]:
    with unprivileged_server(home) as running:
        yield running


@contextmanager
def unprivileged_server(tmp_path: Path, **extra: str) -> Iterator[Server]:
    """`rlserve serve` with keys, as an unprivileged user when this test runs as root."""
    home = _owned_dir(tmp_path / "home")
    env = {
        "HOME": str(home),
        "RLSERVE_MODELS__CACHE_DIR": str(_owned_dir(tmp_path / "cache")),
        "RLSERVE_STORAGE__DATA_DIR": str(_owned_dir(tmp_path / "data")),
        "RLSERVE_AUTH__API_KEYS": USER_KEY,
        "RLSERVE_AUTH__ADMIN_API_KEYS": ADMIN_KEY,
        "RLSERVE_TOOLS__TIMEOUT_S": "20",
        **extra,
    }
    port = free_port()
    command = [sys.executable, "-m", "app.cli", "serve", "--port", str(port)]
    if os.geteuid() == 0:
        drop = f"--reuid={UNPRIVILEGED}", f"--regid={UNPRIVILEGED}", "--clear-groups"
        command = ["setpriv", *drop, *command]
    with running_process(command, port, "/ready", env=env, log=tmp_path / "server.log") as s:
        yield s


def tool_env(server: Server, batch_size: int = 1) -> str:
    body = {"tools": ["python"], "batch_size": batch_size, "max_turns": 4}
    created = httpx.post(f"{server.url}/v1/envs", json=body, headers=HEADERS)
    assert created.status_code == 201, created.text
    env_id: str = created.json()["env_id"]
    reset = {"query": [f"q{i}" for i in range(batch_size)]}
    httpx.post(f"{server.url}/v1/envs/{env_id}/reset", json=reset, headers=HEADERS)
    return env_id


def run_tool(server: Server, env_id: str, code: str, timeout: float = 60) -> str:
    action = {"text": f"```python\n{code}\n```"}
    step = httpx.post(
        f"{server.url}/v1/envs/{env_id}/step",
        json={"actions": [action]},
        headers=HEADERS,
        timeout=timeout,
    )
    assert step.status_code == 200, step.text
    (result,) = step.json()["outputs"][0]["info"]["tool_results"]
    output: str = result["output"]
    return output


def sandboxed(marker: str) -> list[int]:
    """The marked processes bwrap started (past its own setup, so each sandbox layer has set
    its parent-death signal): those not themselves bwrap or setpriv, whose command lines carry
    the code too."""
    found = []
    for pid in host_processes_with(marker):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                program = os.path.basename(cmdline.read().split(b"\0", 1)[0])
        except FileNotFoundError:
            continue
        if program not in (b"bwrap", b"setpriv"):
            found.append(pid)
    return found


def left_running(marker: str, within_s: float = 5) -> list[int]:
    """The marked processes still alive once they had `within_s` to end."""
    deadline = time.monotonic() + within_s
    while host_processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return host_processes_with(marker)


def test_the_non_root_server_is_out_of_reach_of_tool_code(server: Server, home: Path) -> None:
    assert os.stat(f"/proc/{server.process.pid}").st_uid != 0 or os.geteuid() != 0
    victim = tool_env(server)
    attacker = tool_env(server)
    store = home / "data" / "sessions.sqlite3"
    port = server.url.rsplit(":", 1)[1]
    keys = [k.encode()[::-1].hex() for k in (USER_KEY, ADMIN_KEY)]
    attack = f"""
import json, os, signal, socket, sqlite3
found = {{}}
blobs = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    for name in ('environ', 'cmdline'):
        try:
            blobs.append(open(f'/proc/{{pid}}/{{name}}', 'rb').read())
        except OSError:
            pass
keys = [bytes.fromhex(k)[::-1] for k in {keys!r}]  # not the keys' own bytes: this is argv
found['key_seen'] = any(k in b''.join(blobs) for k in keys)
found['pids'] = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
s = socket.socket(); s.settimeout(2)
found['api_reachable'] = s.connect_ex(('127.0.0.1', {port})) == 0
try:
    sqlite3.connect('file:{store}?mode=rw', uri=True).execute(
        "UPDATE sessions SET state = '{{}}'")
    found['store'] = 'written'
except Exception as error:
    found['store'] = type(error).__name__
killed = []
for pid in range(1, 4096):
    if pid != os.getpid():
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except OSError:
            pass
found['killed'] = killed
print(json.dumps(found))
"""
    report = json.loads(run_tool(server, attacker, attack).strip().splitlines()[-1])
    assert report["key_seen"] is False
    assert report["pids"] == [1, 2]  # bwrap's init and the code itself: nothing else is there
    assert report["api_reachable"] is False
    assert report["store"] == "OperationalError"  # the store's path does not exist in there
    assert report["killed"] in ([], [1])  # at most its own init, which ends only its own run
    assert server.process.poll() is None
    assert httpx.get(f"{server.url}/health").status_code == 200
    state = httpx.get(f"{server.url}/v1/envs/{victim}", headers=HEADERS).json()
    assert state["started"] is True and state["rows"][0]["turns"] == 0
    with sqlite3.connect(store) as db:
        assert db.execute("SELECT COUNT(*) FROM sessions WHERE state = '{}'").fetchone()[0] == 0


def test_escaped_processes_end_with_the_step(server: Server) -> None:
    env_id = tool_env(server)
    marker = f"rlserve-escape-{uuid.uuid4().hex}"
    code = escaper(marker, seconds=120) + "print('left behind')\n"
    assert run_tool(server, env_id, code).strip() == "left behind"
    assert left_running(marker, within_s=3) == []


def test_health_answers_during_a_64_row_tool_step(server: Server) -> None:
    env_id = tool_env(server, batch_size=64)
    action = {"text": "```python\nimport time\ntime.sleep(0.2)\nprint('done')\n```"}
    latencies: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        step = httpx.post(
            f"{server.url}/v1/envs/{env_id}/step",
            json={"actions": [action] * 64},
            headers=HEADERS,
            timeout=120,
        )
    finally:
        stop.set()
        prober.join()
    assert step.status_code == 200, step.text
    results = [o["info"]["tool_results"][0] for o in step.json()["outputs"]]
    assert all(r["ok"] and r["output"] == "done\n" for r in results)
    print(f"/health during a 64-row tool step: max {max(latencies) * 1000:.1f} ms")
    assert max(latencies) < 1.0  # a stalled event loop would hold it for the whole step


def test_a_killed_server_leaves_no_tool_process(home: Path) -> None:
    marker = f"rlserve-orphan-{uuid.uuid4().hex}"
    code = sleeper(marker, seconds=120)
    with unprivileged_server(home) as server:
        env_id = tool_env(server)
        action = {"text": f"```python\n{code}\n```"}
        client = httpx.Client(timeout=60)
        pending = threading.Thread(
            target=lambda: _ignore(
                lambda: client.post(
                    f"{server.url}/v1/envs/{env_id}/step",
                    json={"actions": [action]},
                    headers=HEADERS,
                )
            )
        )
        pending.start()
        # Killed once the code runs: bwrap's command line carries the marker from its exec,
        # before it has set its parent-death signal (a kill in that window is left alone).
        deadline = time.monotonic() + 20
        while not sandboxed(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandboxed(marker)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        assert left_running(marker) == []
        pending.join(timeout=60)


def _ignore(call: Callable[[], object]) -> None:
    with suppress(httpx.HTTPError):
        call()


def test_a_client_that_goes_away_cancels_its_tool_run_and_changes_nothing(
    server: Server,
) -> None:
    env_id = tool_env(server)
    marker = f"rlserve-gone-{uuid.uuid4().hex}"
    action = {"text": f"```python\n{sleeper(marker, seconds=120)}\n```"}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(
            f"{server.url}/v1/envs/{env_id}/step",
            json={"actions": [action]},
            headers=HEADERS,
            timeout=httpx.Timeout(10, read=1.5),
        )
    assert left_running(marker) == []  # 20 s before its own timeout would end it
    state = httpx.get(f"{server.url}/v1/envs/{env_id}", headers=HEADERS).json()
    assert state["rows"][0]["turns"] == 0
