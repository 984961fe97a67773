"""rlserve's own cost per request: a model whose compute is negligible (the built-in model, 64
wide and 2 layers), 32 concurrent clients, JSON and binary (safetensors) bodies.

    .venv/bin/python bench/overhead.py              # transformers backend
    .venv-vllm/bin/python bench/overhead.py --vllm  # also the vLLM backend and `vllm serve`
    .venv/bin/python bench/overhead.py --quick      # smoke run (CI)
    .venv/bin/python bench/overhead.py --profile    # py-spy flame graphs of the server
    .venv/bin/python bench/overhead.py --load httpx # the Python load generator instead of wrk

The load comes from `wrk` (Debian's package; scripts/system-deps.sh installs it), whose C event
loops cost the 2 cores a few percent; the Python generator (httpx) costs 3-4 ms of CPU per
request, more than the service, and so paces every run it drives on this machine.

Each runs against the transformers backend and against `none`: the same service with models
that cost nothing (bench/null_server.py), which leaves the service's own cost alone.

Work: score one 128-token sequence per request; score 32 of them per request; generate 16
tokens for one 16-token prompt; step an environment session (text action, no tools). Figures
are sequences (or requests, or steps) per second; `vllm serve` answers the same scoring and
generation through /v1/completions (`prompt_logprobs`, token prompts)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import wrk_load
from common import (
    ROOT,
    bench_arguments,
    bench_model,
    free_port,
    running_process,
    running_server,
    summarize,
    vllm_serve_command,
)
from rlserve_client import tensor_wire

CLIENTS = 32
SEQ_LEN = 128
NEW_TOKENS = 16
BATCH = 32
KV_CACHE_BYTES = 256 << 20
ENV_TURNS = 100_000  # sessions stepped for a duration (wrk) must not run out of turns
EPISODE_TURNS = 16  # steps per episode (each session is reset before each episode)
# The figures for this machine before the work (JSON bodies, transformers backend).
BASELINE = {"score_1": 180.0, "score_32": 661.0, "generate_16": 182.0}

Request = tuple[str, str, bytes, dict[str, str]]  # method, path, body, headers


def json_request(path: str, body: dict[str, Any]) -> Request:
    return ("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})


def binary_request(path: str, body: dict[str, Any]) -> Request:
    headers = {"Content-Type": tensor_wire.MEDIA_TYPE, "Accept": tensor_wire.MEDIA_TYPE}
    return ("POST", path, tensor_wire.encode(body), headers)


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) process `pid` has used so far; this process's when None."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(
    url: str, requests: list[Request], clients: int, per_request: float, pid: int | None = None
) -> dict[str, Any]:
    """Send `requests` from `clients` concurrent connections (one warm-up each first);
    `per_request` sequences (or steps) per request for the rate. With the server's `pid`, also
    the CPU milliseconds the server and this load generator spent per request: the service's
    cost whatever paces the run (on 2 cores, the generator's own Python can be the limit)."""
    latencies: list[float] = []
    queue = list(reversed(requests))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def send(request: Request) -> None:
            method, path, body, headers = request
            response = await client.request(method, path, content=body, headers=headers)
            response.raise_for_status()

        async def worker() -> None:
            while queue:
                request = queue.pop()
                start = time.perf_counter()
                await send(request)
                latencies.append(time.perf_counter() - start)

        await asyncio.gather(*(send(r) for r in requests[:clients]))
        start = time.perf_counter()
        server_cpu, client_cpu = cpu_seconds(pid), cpu_seconds(None)
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
        server_cpu, client_cpu = cpu_seconds(pid) - server_cpu, cpu_seconds(None) - client_cpu
    figures = summarize(latencies, seconds, per_request).as_dict()
    figures["per_s"] = round(figures.pop("tokens_per_s"), 1)  # sequences, requests or steps
    if pid is not None:
        figures["server_cpu_ms"] = round(1000 * server_cpu / len(latencies), 3)
        figures["client_cpu_ms"] = round(1000 * client_cpu / len(latencies), 3)
    return figures


def rlserve_work(
    rng: random.Random, count: int, binary: bool
) -> dict[str, tuple[list[Request], int]]:
    def seq(length: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(length)]

    make = binary_request if binary else json_request

    def tokens(rows: list[list[int]]) -> Any:
        if not binary:
            return rows
        import torch

        return torch.tensor(rows)

    return {
        "score_1": (
            [make("/v1/logprobs", {"tokens": tokens([seq(SEQ_LEN)])}) for _ in range(count)],
            1,
        ),
        "score_32": (
            [
                make("/v1/logprobs", {"tokens": tokens([seq(SEQ_LEN) for _ in range(BATCH)])})
                for _ in range(max(count // 8, CLIENTS))
            ],
            BATCH,
        ),
        "generate_16": (
            [
                make(
                    "/v1/generate",
                    {
                        "tokens": tokens([seq(16)]),
                        "max_new_tokens": NEW_TOKENS,
                        "ignore_eos": True,
                        "seed": i,
                    },
                )
                for i in range(count)
            ],
            1,
        ),
    }


def vllm_work(rng: random.Random, count: int, model: str) -> dict[str, tuple[list[Request], int]]:
    def seq(length: int) -> list[int]:
        return [rng.randrange(3, 250) for _ in range(length)]

    return {
        "score_1": (
            [
                json_request(
                    "/v1/completions",
                    {
                        "model": model,
                        "prompt": seq(SEQ_LEN),
                        "max_tokens": 1,
                        "prompt_logprobs": 0,
                        "temperature": 0.0,
                    },
                )
                for _ in range(count)
            ],
            1,
        ),
        "generate_16": (
            [
                json_request(
                    "/v1/completions",
                    {
                        "model": model,
                        "prompt": seq(16),
                        "max_tokens": NEW_TOKENS,
                        "ignore_eos": True,
                        "seed": i,
                        "logprobs": 0,
                    },
                )
                for i in range(count)
            ],
            1,
        ),
    }


def env_steps(
    args: argparse.Namespace,
    url: str,
    steps: int,
    pid: int | None = None,
    *,
    turns: int = EPISODE_TURNS,
) -> dict[str, Any]:
    """CLIENTS sessions of batch 1, each driven from one connection through episodes of
    `turns` text actions, a reset before each: `steps` requests in all (httpx), or for
    `args.seconds` (wrk). Episodes of fixed length keep a step's history, and so its cost,
    independent of the rate and the run's length. The rate counts steps; the resets' time is
    in it."""
    envs = asyncio.run(env_sessions(url, CLIENTS))
    cycle = turns + 1
    requests = []
    for i in range(CLIENTS * cycle * -(-steps // (CLIENTS * cycle))):  # whole episodes
        env, turn = envs[i % CLIENTS], (i // CLIENTS) % cycle
        if turn == 0:
            requests.append(json_request(f"/v1/envs/{env}/reset", {"query": ["2 + 2?"]}))
        else:
            action = {"actions": [{"text": f"answer {i}"}]}
            requests.append(json_request(f"/v1/envs/{env}/step", action))
    return {**send(args, url, requests, turns / cycle, pid), "episode_turns": turns}


async def env_sessions(url: str, clients: int) -> list[str]:
    """`clients` environment sessions of batch 1, reset."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        envs = []
        for _ in range(clients):
            body = {"batch_size": 1, "max_turns": ENV_TURNS}
            created = await client.post("/v1/envs", json=body)
            created.raise_for_status()
            env = created.json()["env_id"]
            (
                await client.post(f"/v1/envs/{env}/reset", json={"query": ["2 + 2?"]})
            ).raise_for_status()
            envs.append(env)
    return envs


def drive_wrk(
    url: str, requests: list[Request], per_request: float, seconds: float, pid: int | None
) -> dict[str, Any]:
    """`drive`'s figures with wrk sending `requests` (cycling) for `seconds`, after a warm-up
    second; the load generator's CPU is wrk's (a child process: its rusage). wrk counts only
    the requests answered within its run: a run in which none was (a loaded machine, requests
    slower than the run) is run again, twice as long, up to 32 s."""
    wrk_load.run(url, requests, CLIENTS, 1)
    while True:
        server_cpu, client_cpu = cpu_seconds(pid), _children_cpu()
        figures = wrk_load.run(url, requests, CLIENTS, seconds)
        server_cpu, client_cpu = cpu_seconds(pid) - server_cpu, _children_cpu() - client_cpu
        if figures["requests"] > 0:
            break
        if seconds >= 32:
            raise RuntimeError(f"wrk saw no request answered in {seconds:g} s: {figures}")
        seconds *= 2
    count, elapsed = figures["requests"], figures["microseconds"] / 1e6
    result: dict[str, Any] = {
        "requests": count,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(count / elapsed, 3),
        "p50_ms": figures["p50_us"] / 1000,
        "p99_ms": figures["p99_us"] / 1000,
        "per_s": round(count * per_request / elapsed, 1),
    }
    if pid is not None:
        result["server_cpu_ms"] = round(1000 * server_cpu / count, 3)
        result["client_cpu_ms"] = round(1000 * client_cpu / count, 3)
    return result


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def send(
    args: argparse.Namespace,
    url: str,
    requests: list[Request],
    per_request: float,
    pid: int | None = None,
) -> dict[str, Any]:
    """`requests` against `url` from the load generator `args.load` names."""
    if args.load == "wrk":
        return drive_wrk(url, requests, per_request, args.seconds, pid)
    return asyncio.run(drive(url, requests, CLIENTS, per_request, pid))


def measure(
    args: argparse.Namespace,
    url: str,
    work: dict[str, tuple[list[Request], int]],
    label: str,
    pid: int | None = None,
) -> dict[str, Any]:
    results = {}
    for name, (requests, per_request) in work.items():
        results[name] = send(args, url, requests, per_request, pid)
        print(f"{label} {name}: {results[name]['per_s']}/s", flush=True)
    return results


def profile(pid: int, seconds: float, output: Path) -> subprocess.Popen[bytes] | None:
    """py-spy sampling the server for `seconds` (None where py-spy is not installed)."""
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    if spy is None:
        print("py-spy is not installed: pip install py-spy", flush=True)
        return None
    command = [
        spy,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(seconds)),
        "--rate",
        "200",
        "--format",
        "flamegraph",
        "--output",
        str(output),
        "--nonblocking",
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_rlserve(args: argparse.Namespace, model_dir: Path, backend: str) -> dict[str, Any]:
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data" / f"overhead-{backend}"),
        "RLSERVE_MODELS__BACKEND": "transformers" if backend == "none" else backend,
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST": "256",
        "RLSERVE_ENVS__MAX_TURNS": str(ENV_TURNS),
    }
    if backend == "vllm":
        env["RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES"] = str(KV_CACHE_BYTES)
    log = args.output / f"overhead-{backend}.log"
    results: dict[str, Any] = {}
    if backend == "none":  # the service alone: models that cost nothing (bench/null_server.py)
        port = free_port()
        command = [sys.executable, str(ROOT / "bench" / "null_server.py"), "--port", str(port)]
        started = running_process(command, port, "/ready", env=env, log=log, timeout=600)
    else:
        started = running_server("--model", str(model_dir), env=env, log=log, ready_timeout=600)
    with started as server:
        for binary in (False, True):
            kind = "binary" if binary else "json"
            work = rlserve_work(random.Random(0), args.requests, binary)
            if args.profile and not binary:
                for name, item in work.items():
                    spy = profile(
                        server.process.pid,
                        args.profile_seconds,
                        args.output / f"overhead-{backend}-{name}.svg",
                    )
                    results.setdefault(kind, {})[name] = send(args, server.url, *item)
                    print(f"{backend} {kind} {name}: {results[kind][name]['per_s']}/s", flush=True)
                    if spy is not None:
                        spy.wait()
                continue
            results[kind] = measure(args, server.url, work, f"{backend} {kind}", server.process.pid)
        results["json"]["env_step"] = env_steps(args, server.url, args.requests, server.process.pid)
        print(f"{backend} json env_step: {results['json']['env_step']['per_s']}/s", flush=True)
    return results


def run_vllm_serve(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    port = free_port()
    command = vllm_serve_command(model_dir, port, KV_CACHE_BYTES, "builtin", "--max-logprobs", "1")
    with running_process(
        command, port, "/v1/models", log=args.output / "overhead-vllm-serve.log", timeout=600
    ) as server:
        work = vllm_work(random.Random(0), args.requests, "builtin")
        return measure(args, server.url, work, "vllm serve", server.process.pid)


def table(report: dict[str, Any]) -> str:
    rows = [
        ("score_1", "score one 128-token sequence per request", "sequences/s"),
        ("score_32", "score 32 sequences of 128 tokens per request", "sequences/s"),
        ("generate_16", "generate 16 tokens, one sequence per request", "requests/s"),
        ("env_step", "env step (text action, no tools)", "steps/s"),
    ]
    columns = [(name, kind) for name in report["backends"] for kind in ("json", "binary")]
    head = "| work | baseline | " + " | ".join(f"{n} {k}" for n, k in columns)
    head += " | vllm serve |" if "vllm_serve" in report else " |"
    lines = [head, "|---" * (len(columns) + 2 + ("vllm_serve" in report)) + "|"]

    def get(figures: dict[str, Any], work: str, key: str = "per_s", form: str = ".0f") -> str:
        return format(figures[work][key], form) if key in figures.get(work, {}) else "-"

    def cpu(figures: dict[str, Any], work: str) -> str:
        server = get(figures, work, "server_cpu_ms", ".2f")
        return f"{server} / {get(figures, work, 'client_cpu_ms', '.2f')}"

    def body(cell: Callable[[dict[str, Any], str], str], label: str, baseline: bool) -> None:
        """One line per work: `cell` of each column's figures (and the baseline's)."""
        for work, text, unit in rows:
            cells = [cell(report["backends"][n].get(k, {}), work) for n, k in columns]
            first = f"| {text} ({label or unit}) | "
            if baseline:
                first += f"{BASELINE.get(work, '-')} | "
            line = first + " | ".join(cells)
            if "vllm_serve" in report:
                line += f" | {cell(report['vllm_serve'], work)}"
            lines.append(line + " |")

    body(get, "", baseline=True)
    # CPU per request of the server's main process (a vLLM engine core, a child, not counted)
    # and of the load generator, whatever the rate above was paced by.
    lines += ["", head.replace("| baseline ", ""), lines[1].removeprefix("|---")]
    body(cpu, "server / load generator CPU ms per request", baseline=False)
    return "\n".join(lines)


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--vllm", action="store_true", help="also the vLLM backend and vllm serve")
    parser.add_argument("--profile", action="store_true", help="py-spy flame graphs (JSON runs)")
    parser.add_argument("--name", default="overhead", help="the results' file name")
    parser.add_argument(
        "--load",
        choices=("wrk", "httpx"),
        default="wrk" if wrk_load.available() else "httpx",
        help="the load generator (default: wrk where installed)",
    )
    args = parser.parse_args()
    args.requests = 64 if args.quick else 2000
    args.seconds = 1 if args.quick else 8  # each run's length under wrk
    args.profile_seconds = 4 if args.quick else 8
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, 64, 2)
    report: dict[str, Any] = {
        "model": "built-in Qwen2, hidden 64, 2 layers, float32 (compute negligible)",
        "clients": CLIENTS,
        "load": args.load,
        "backends": {"transformers": run_rlserve(args, model_dir, "transformers")},
        "baseline_json_transformers": BASELINE,
    }
    # The same work against models that cost nothing: what the service alone can carry.
    report["backends"]["none"] = run_rlserve(args, model_dir, "none")
    if args.vllm:
        report["backends"]["vllm"] = run_rlserve(args, model_dir, "vllm")
        report["vllm_serve"] = run_vllm_serve(args, model_dir)
    name = f"{args.name}-quick" if args.quick else args.name
    (args.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))


if __name__ == "__main__":
    main()
