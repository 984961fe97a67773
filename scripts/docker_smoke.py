"""The CPU image built and run for real with Docker Compose, then checked from outside:

- the base: the public python image when it can be pulled, otherwise one built from Debian's
  packages (scripts/docker-base.sh), and then the image builds with no network at all;
- the wheelhouse the host's pip fills (scripts/docker-wheelhouse.sh), so the image gets the
  same CPU torch the tests use;
- closed by default: the container started from .env.example as shipped (no API keys, on the
  0.0.0.0 the image listens on), or with an old or misspelt name in its env file, refuses
  to start, saying why, and never answers;
- `docker compose --profile cpu up` with a key in the env file, the healthcheck, requests
  without it refused (401), /v1/generate and /v1/logprobs, an
  environment step whose python tool runs isolated inside the container, the server running
  as non-root, a session surviving `docker compose restart` on the volume, and
  `docker compose stop` ending the server gracefully within the grace period;
- everything torn down at the end (containers, network, volume; the image is kept);
- the GPU image's build on its pinned vLLM base, when that base can be pulled.

    scripts/docker-smoke.sh [--json PATH]      (starts dockerd when none runs; root)

Prints each check and the figures (image sizes, build time, time to healthy); exits 1 when
a check failed."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PUBLIC_BASE = "python:3.11-slim-bookworm"
LOCAL_BASE = "rlserve-base:bookworm"
IMAGE = "rlserve:cpu"
PROJECT = "rlserve-smoke"
SERVICE = "rlserve-cpu"
GRACE_S = 60  # the compose file's stop_grace_period
KEY = "smoke-key"


class Smoke:
    def __init__(self) -> None:
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
        return ok

    def figure(self, name: str, value: Any) -> None:
        self.figures[name] = value
        print(f"     {name} = {value}", flush=True)


def sh(*command: str, env: dict[str, str] | None = None, timeout: float = 1800) -> str:
    """Run a command; its stdout (it must succeed)."""
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return done.stdout


def compose_command() -> list[str]:
    """Docker Compose v2 (the `docker compose` plugin): v1 cannot pass the container's
    `systempaths=unconfined`, which the python tool needs."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        raise SystemExit("no Docker Compose v2: scripts/docker-deps.sh installs it from Debian")
    return ["docker", "compose"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def request(
    url: str, body: Any = None, method: str | None = None, key: str | None = KEY
) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    call = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(call, timeout=120) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def request_status(url: str) -> int:
    """The status of GET `url`; 0 while nothing answers."""
    try:
        return request(url)[0]
    except (OSError, ValueError):
        return 0


def image_mb(image: str) -> float:
    return round(int(sh("docker", "image", "inspect", "-f", "{{.Size}}", image)) / 1e6, 1)


def wait_healthy(container: str, timeout: float = 600) -> float:
    """Seconds until Docker's healthcheck says healthy (it runs every 15 s)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        state = sh(
            "docker", "inspect", "-f", "{{.State.Status}} {{.State.Health.Status}}", container
        )
        if state.split()[-1] == "healthy":
            return round(time.monotonic() - start, 1)
        if state.split()[0] in {"exited", "dead"}:
            raise RuntimeError(f"the container stopped: {sh('docker', 'logs', container)[-3000:]}")
        time.sleep(1)
    raise RuntimeError(f"not healthy after {timeout:g} s")


def build(smoke: Smoke) -> str:
    """The base image (pulled or built locally), the wheelhouse, then the CPU image."""
    start = time.monotonic()
    pulled = subprocess.run(["docker", "pull", PUBLIC_BASE], capture_output=True).returncode == 0
    base = PUBLIC_BASE if pulled else LOCAL_BASE
    if not pulled:
        print(f"     {PUBLIC_BASE} cannot be pulled: building {LOCAL_BASE} from Debian", flush=True)
        sh(str(ROOT / "scripts/docker-base.sh"), LOCAL_BASE)
    smoke.figure("base_image", base)
    smoke.figure("base_seconds", round(time.monotonic() - start, 1))
    smoke.figure("base_mb", image_mb(base))

    start = time.monotonic()
    print(sh(str(ROOT / "scripts/docker-wheelhouse.sh")).strip(), flush=True)
    smoke.figure("wheelhouse_seconds", round(time.monotonic() - start, 1))

    # On the local base nothing needs the network: the build proves it by having none.
    network = [] if pulled else ["--network", "none"]
    start = time.monotonic()
    sh(
        "docker", "build", *network, "-f", "docker/Dockerfile.cpu",
        "--build-arg", f"BASE_IMAGE={base}", "-t", IMAGE, ".",
        env={"DOCKER_BUILDKIT": "0"},
    )  # fmt: skip
    smoke.figure("build_seconds", round(time.monotonic() - start, 1))
    smoke.figure("image_mb", image_mb(IMAGE))
    return base


def build_gpu_image(smoke: Smoke) -> None:
    """The GPU image's layers on its pinned vLLM base, when that base can be pulled (it can
    only run on a GPU host); otherwise said why not."""
    pinned = next(
        line.split("=", 1)[1]
        for line in (ROOT / "docker/Dockerfile").read_text().splitlines()
        if line.startswith("ARG VLLM_IMAGE=")
    )
    if subprocess.run(["docker", "pull", pinned], capture_output=True).returncode != 0:
        smoke.figure("gpu_image", f"not built: its base {pinned} cannot be pulled here")
        return
    start = time.monotonic()
    sh("docker", "build", "-f", "docker/Dockerfile", "-t", "rlserve:gpu", ".")
    smoke.figure("gpu_build_seconds", round(time.monotonic() - start, 1))
    smoke.figure("gpu_image_mb", image_mb("rlserve:gpu"))


def refused_start(compose: list[str], env: dict[str, str], url: str) -> tuple[bool, str]:
    """Start the service from `env`'s env file, which must not serve: whether it stopped
    itself without ever answering /ready, and what it said."""
    sh(*compose, "--profile", "cpu", "up", "-d", "--no-build", SERVICE, env=env)
    container = sh(*compose, "ps", "-aq", SERVICE, env=env).strip()
    said, answered, deadline = "", False, time.monotonic() + 120
    try:
        while time.monotonic() < deadline and "cannot start" not in said:
            answered |= request_status(f"{url}/ready") == 200
            logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
            said = logs.stdout + logs.stderr
            time.sleep(0.5)
        code = sh("docker", "inspect", "-f", "{{.State.ExitCode}}", container).strip()
    finally:
        sh(*compose, "--profile", "cpu", "rm", "-sf", SERVICE, env=env)
    # (`restart: unless-stopped` starts it again and again: each start refused the same way)
    return "cannot start" in said and not answered and code in {"0", "2"}, said.strip()


def closed_by_default(smoke: Smoke, compose: list[str], env: dict[str, str], url: str) -> None:
    """What a fresh deployment gets wrong never serves open: the env file as shipped (no
    keys), the old key name, a misspelt one."""
    shipped = (ROOT / ".env.example").read_text()
    cases = {
        "no API keys on 0.0.0.0": ("", "would listen on 0.0.0.0, beyond loopback"),
        "the old key name": ("RLSERVE_API_KEYS=k\n", "RLSERVE_API_KEYS is not read"),
        "a misspelt key name": (
            "RLSERVE_AUTH__API_KEY=k\n",
            "did you mean RLSERVE_AUTH__API_KEYS?",
        ),
    }
    env_file = Path(env["RLSERVE_ENV_FILE"])
    for name, (extra, reason) in cases.items():
        env_file.write_text(shipped + extra)
        start = time.monotonic()
        stopped, said = refused_start(compose, env, url)
        smoke.check(
            f"refuses to start: {name}",
            stopped and reason in said,
            f"{round(time.monotonic() - start, 1)} s; it said: {said[-300:]!r}",
        )


def exercise(smoke: Smoke, compose: list[str], env: dict[str, str], url: str) -> None:
    env_file = Path(env["RLSERVE_ENV_FILE"])
    env_file.write_text((ROOT / ".env.example").read_text() + f"RLSERVE_AUTH__API_KEYS={KEY}\n")
    up = time.monotonic()
    sh(*compose, "--profile", "cpu", "up", "-d", "--no-build", SERVICE, env=env)
    container = sh(*compose, "ps", "-q", SERVICE, env=env).strip()
    while request_status(f"{url}/ready") != 200 and time.monotonic() - up < 600:
        time.sleep(0.2)
    smoke.figure("seconds_to_ready", round(time.monotonic() - up, 1))
    healthy = wait_healthy(container)
    smoke.check("healthcheck", True, f"healthy {round(time.monotonic() - up, 1)} s after up")
    smoke.figure("seconds_to_healthy", healthy)
    body = {"text": ["Hello"], "max_tokens": 2}
    statuses = [request(f"{url}/v1/generate", body, key=k)[0] for k in (None, "wrong")]
    smoke.check("keys required", statuses == [401, 401], f"no key, a wrong key: {statuses}")

    status, generated = request(
        f"{url}/v1/generate", {"text": ["Hello"], "max_tokens": 8, "temperature": 0}
    )
    sample = generated["outputs"][0][0] if status == 200 else {}
    response = sample.get("tokens", {}).get("response", [])
    smoke.check("generate", status == 200 and 0 < len(response) <= 8, f"{len(response)} tokens")
    full = sample.get("tokens", {}).get("full", [72, 105])
    status, scored = request(f"{url}/v1/logprobs", {"tokens": [full]})
    values = scored["outputs"][0]["log_probs"]["full"] if status == 200 else []
    finite = all(math.isfinite(v) and v <= 0 for v in values[1:])
    smoke.check(
        "logprobs", status == 200 and len(values) == len(full) and finite, f"{len(values)} values"
    )

    status, created = request(f"{url}/v1/envs", {"tools": ["python"], "max_turns": 2})
    env_id = created.get("env_id") if status == 201 else None
    code = (
        "import os, socket\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 8000), timeout=2); net = 'open'\n"
        "except OSError:\n"
        "    net = 'blocked'\n"
        "print(net, os.getuid(), len([p for p in os.listdir('/proc') if p.isdigit()]))"
    )
    output = ""
    if env_id:
        request(f"{url}/v1/envs/{env_id}/reset", {"query": ["q"]})
        action = {"text": f"```python\n{code}\n```"}
        status, stepped = request(f"{url}/v1/envs/{env_id}/step", {"actions": [action]})
        if status == 200:
            (result,) = stepped["outputs"][0]["info"]["tool_results"]
            output = result["output"].strip()
    net, _, pids = [*output.split(), "", "", ""][:3]
    smoke.check(
        "python tool isolated in the container",
        net == "blocked" and pids.isdigit() and int(pids) <= 3,
        f"the tool printed {output!r} (network to the server, uid, processes it sees)",
    )

    status_line = sh("docker", "exec", container, "grep", "^Uid:", "/proc/1/status").split()
    smoke.check(
        "server runs as non-root", status_line[1:3] == ["1000", "1000"], " ".join(status_line)
    )

    status, created = request(f"{url}/v1/envs", {"kind": "tokens"})
    session = created["env_id"]
    request(f"{url}/v1/envs/{session}/reset", {"tokens": [[5, 6]]})
    request(f"{url}/v1/envs/{session}/step", {"actions": [{"tokens": [7]}]})
    restart = time.monotonic()
    sh(*compose, "restart", SERVICE, env=env)
    wait_healthy(container)
    smoke.figure("seconds_restart_to_healthy", round(time.monotonic() - restart, 1))
    status, state = request(f"{url}/v1/envs/{session}")
    turns = state["rows"][0]["turns"] if status == 200 else None
    smoke.check(
        "session survives restart", turns == 1, f"GET after restart: {status}, turns {turns}"
    )

    stop = time.monotonic()
    sh(*compose, "stop", SERVICE, env=env)
    took = round(time.monotonic() - stop, 1)
    code_after = sh("docker", "inspect", "-f", "{{.State.ExitCode}}", container).strip()
    logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True)
    graceful = "Application shutdown complete" in logs.stdout + logs.stderr
    smoke.check(
        "graceful stop",
        took < GRACE_S and code_after == "0" and graceful,
        f"{took} s (grace {GRACE_S} s), exit code {code_after}, shutdown logged: {graceful}",
    )


def teardown(smoke: Smoke, compose: list[str], env: dict[str, str]) -> None:
    try:
        sh(*compose, "--profile", "cpu", "down", "-v", "--remove-orphans", env=env)
        label = f"label=com.docker.compose.project={PROJECT}"
        left = sh("docker", "ps", "-aq", "--filter", label)
        volumes = sh("docker", "volume", "ls", "-q", "--filter", label)
        smoke.check("torn down", not left.strip() and not volumes.strip(), "containers, volume")
    except Exception as exc:  # reported as the failed check
        smoke.check("torn down", False, str(exc)[-2000:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the checks and figures here")
    args = parser.parse_args()
    smoke = Smoke()
    compose_base = compose_command()
    port = free_port()
    base = LOCAL_BASE
    try:
        base = build(smoke)
    except Exception as exc:  # reported as the failed check
        smoke.check("build", False, str(exc)[-2000:])
    compose = [
        *compose_base,
        "-p",
        PROJECT,
        "--env-file",
        ".env.example",
        "-f",
        "docker-compose.yml",
    ]
    settings = Path(tempfile.mkdtemp()) / "operator.env"  # the operator's .env
    env = {
        "RLSERVE_CPU_PORT": str(port),
        "RLSERVE_BASE_IMAGE": base,
        "RLSERVE_ENV_FILE": str(settings),
    }
    if all(c["ok"] for c in smoke.checks):
        try:
            closed_by_default(smoke, compose, env, f"http://127.0.0.1:{port}")
            exercise(smoke, compose, env, f"http://127.0.0.1:{port}")
        except Exception as exc:  # reported as the failed check
            smoke.check("run", False, str(exc)[-2000:])
        finally:
            teardown(smoke, compose, env)
            shutil.rmtree(settings.parent, ignore_errors=True)
    if all(c["ok"] for c in smoke.checks):
        try:
            build_gpu_image(smoke)
        except Exception as exc:  # reported as the failed check
            smoke.check("gpu image build", False, str(exc)[-2000:])
    if args.json is not None:
        args.json.write_text(
            json.dumps({"checks": smoke.checks, "figures": smoke.figures}, indent=2)
        )
    failed = [c["check"] for c in smoke.checks if not c["ok"]]
    print(f"docker smoke: {len(smoke.checks) - len(failed)} of {len(smoke.checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
