"""What Ray Serve's proxy costs: the same load against the plain server and against one replica
behind Ray Serve (`rlserve serve --replicas 1`, a local Ray cluster), transformers backend.

    python bench/ray_serve.py          # 512-wide 6-layer built-in model
    python bench/ray_serve.py --quick  # smoke run

Generation: 32 new tokens per request; scoring: 256-token sequences. Requests/s, p50, p99.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from typing import Any

from common import (
    bench_arguments,
    bench_model,
    drive,
    free_port,
    ray_serve_env,
    running_process,
    running_server,
    save_report,
    throughput_ratios,
)


def workload(args: argparse.Namespace) -> dict[str, tuple[str, list[dict[str, Any]], int]]:
    rng = random.Random(0)
    generate = [
        {
            "tokens": [[rng.randrange(256) for _ in range(16)]],
            "max_tokens": 32,
            "ignore_eos": True,
            "seed": i,
        }
        for i in range(args.requests)
    ]
    score = [{"tokens": [[rng.randrange(256) for _ in range(256)]]} for _ in range(args.requests)]
    return {"generate": ("/v1/generate", generate, 32), "score": ("/v1/logprobs", score, 256)}


def measure(name: str, url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for clients in args.clients:
        out[str(clients)] = {
            kind: asyncio.run(drive(url, route, work, clients, tokens)).as_dict()
            for kind, (route, work, tokens) in workload(args).items()
        }
        print(name, clients, out[str(clients)], flush=True)
    return out


def main() -> None:
    parser = bench_arguments(__doc__)
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (512, 6)
    args.requests = 16 if args.quick else 128
    args.clients = [8] if args.quick else [8, 32]
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, hidden, layers)
    env = ray_serve_env(args.output)
    with running_server(
        "--model", str(model_dir), env=env, log=args.output / "plain.log", ready_timeout=600
    ) as plain:
        results = {"plain": measure("plain", plain.url, args)}
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "app.cli",
        "serve",
        "--replicas",
        "1",
        "--port",
        str(port),
        "--model",
        str(model_dir),
    ]
    log = args.output / "ray-serve.log"
    # The server starts a local Ray cluster and stops it when it is stopped.
    with running_process(command, port, "/ready", env=env, log=log, timeout=600) as served:
        results["ray_serve_1_replica"] = measure("ray serve", served.url, args)
    ratios = throughput_ratios(
        results["ray_serve_1_replica"], results["plain"], ("generate", "score")
    )
    report = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, transformers, CPU",
        "workload": {"requests_per_point": args.requests, "new_tokens": 32, "score_tokens": 256},
        "results": results,
        "ray_serve_over_plain": ratios,
        "goals": {
            "overhead_at_most_10_percent": all(
                r >= 0.9 for v in ratios.values() for r in v.values()
            )
        },
    }
    save_report(args, "ray_serve", report)
    print(json.dumps({"ratios": ratios, "goals": report["goals"]}, indent=2))


if __name__ == "__main__":
    main()
