"""Throughput and latency of /v1/logprobs and /v1/generate with batching on and off, against
the in-process limit (the backend called directly with the same work in full batches).

    python bench/batching.py            # full run (benchmark-size model, a few minutes)
    python bench/batching.py --quick    # smoke run on the small model
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import httpx
from common import Figures, bench_arguments, bench_model, running_server, summarize

from app.engine.transformers.backend import TransformersBackend
from app.engine.types import GenerateItem, SamplingConfig


def make_work(args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(0)
    scoring = [[rng.randrange(256) for _ in range(args.seq_len)] for _ in range(args.requests)]
    prompts = [[rng.randrange(256) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    return scoring, prompts


def generate_body(prompt: list[int], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {"tokens": [prompt], "max_tokens": args.new_tokens, "ignore_eos": True, "seed": seed}


async def drive(
    url: str, route: str, bodies: list[dict[str, Any]], concurrency: int
) -> tuple[list[float], float]:
    """`concurrency` clients, each sending its share of `bodies` one after another."""
    latencies: list[float] = []
    queue = list(reversed(bodies))
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                response = await client.post(route, json=body)
                response.raise_for_status()
                latencies.append(time.perf_counter() - start)

        await client.post(route, json=bodies[0])  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - start


def measure_server(
    model_dir: Path, batching: bool, args: argparse.Namespace, log: Path
) -> dict[str, dict[int, Figures]]:
    scoring, prompts = make_work(args)
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_BATCHING__ENABLED": str(batching).lower(),
        "RLSERVE_BATCHING__MAX_BATCH_SIZE": str(args.batch),
    }
    results: dict[str, dict[int, Figures]] = {"logprobs": {}, "generate": {}}
    with running_server("--model", str(model_dir), env=env, log=log) as server:
        for concurrency in args.concurrency:
            bodies = [{"tokens": [seq]} for seq in scoring]
            lat, secs = asyncio.run(drive(server.url, "/v1/logprobs", bodies, concurrency))
            results["logprobs"][concurrency] = summarize(lat, secs, args.seq_len)
            gen_bodies = [generate_body(p, args, i) for i, p in enumerate(prompts)]
            lat, secs = asyncio.run(drive(server.url, "/v1/generate", gen_bodies, concurrency))
            results["generate"][concurrency] = summarize(lat, secs, args.new_tokens)
            print(
                f"batching={'on ' if batching else 'off'} clients={concurrency:3d} "
                f"logprobs {results['logprobs'][concurrency].requests_per_s:7.2f} req/s  "
                f"generate {results['generate'][concurrency].requests_per_s:7.2f} req/s",
                flush=True,
            )
    return results


def measure_in_process(model_dir: Path, args: argparse.Namespace) -> dict[str, Figures]:
    """The same total work, called on the backend directly in full batches."""
    backend = TransformersBackend.load(str(model_dir), name="policy")
    scoring, prompts = make_work(args)
    config = SamplingConfig(max_new_tokens=args.new_tokens, ignore_eos=True)

    async def run() -> dict[str, Figures]:
        await backend.score(scoring[: args.batch])  # warm-up
        out = {}
        start = time.perf_counter()
        for i in range(0, len(scoring), args.batch):
            await backend.score(scoring[i : i + args.batch])
        secs = time.perf_counter() - start
        out["logprobs"] = summarize([secs / len(scoring)] * len(scoring), secs, args.seq_len)
        items = [GenerateItem(tuple(p), config, i) for i, p in enumerate(prompts)]
        start = time.perf_counter()
        for i in range(0, len(items), args.batch):
            await backend.generate(items[i : i + args.batch])
        secs = time.perf_counter() - start
        out["generate"] = summarize([secs / len(items)] * len(items), secs, args.new_tokens)
        await backend.aclose()
        return out

    return asyncio.run(run())


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, route in zip(axes, ("logprobs", "generate"), strict=True):
        for mode in ("on", "off"):
            series = report["http"][mode][route]
            xs = sorted(int(c) for c in series)
            ax.plot(
                xs,
                [series[str(c)]["requests_per_s"] for c in xs],
                marker="o",
                label=f"batching {mode}",
            )
        ax.axhline(
            report["in_process"][route]["requests_per_s"],
            ls="--",
            c="grey",
            label="in-process limit",
        )
        ax.set(xscale="log", xlabel="concurrent clients", ylabel="requests/s", title=f"/v1/{route}")
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.legend()
    fig.suptitle(report["model"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(report: dict[str, Any]) -> str:
    """Markdown table of the report (what the README shows)."""
    lines = [
        "| route | clients | batching on req/s | p50 / p99 ms "
        "| batching off req/s | p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    http = report["http"]
    for route in ("logprobs", "generate"):
        for clients in http["on"][route]:
            on, off = http["on"][route][clients], http["off"][route][clients]
            lines.append(
                f"| /v1/{route} | {clients} | {on['requests_per_s']:.2f} | "
                f"{on['p50_ms']:.0f} / {on['p99_ms']:.0f} | {off['requests_per_s']:.2f} | "
                f"{off['p50_ms']:.0f} / {off['p99_ms']:.0f} |"
            )
        limit = report["in_process"][route]["requests_per_s"]
        lines.append(f"| /v1/{route} | in-process limit | {limit:.2f} | | | |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--report-only", action="store_true", help="redraw from the saved JSON")
    args = parser.parse_args()
    name = "batching-quick" if args.quick else "batching"
    if args.report_only:
        report = json.loads((args.output / f"{name}.json").read_text())
        write_report(report, args.output, name)
        return
    hidden, layers = (64, 2) if args.quick else (512, 6)
    args.requests = 16 if args.quick else 64
    args.concurrency = [1, 8] if args.quick else [1, 8, 32, 64]
    args.seq_len, args.prompt_len, args.new_tokens, args.batch = 256, 16, 32, 32
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, hidden, layers)

    def as_json(results: dict[str, dict[int, Figures]]) -> dict[str, Any]:
        return {r: {str(c): f.as_dict() for c, f in v.items()} for r, v in results.items()}

    report: dict[str, Any] = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, CPU",
        "workload": {
            "requests_per_point": args.requests,
            "logprobs_tokens": args.seq_len,
            "generate_prompt_tokens": args.prompt_len,
            "generate_new_tokens": args.new_tokens,
            "max_batch_size": args.batch,
        },
        "in_process": {k: v.as_dict() for k, v in measure_in_process(model_dir, args).items()},
        "http": {
            mode: as_json(
                measure_server(model_dir, mode == "on", args, args.output / f"server-{mode}.log")
            )
            for mode in ("on", "off")
        },
    }
    report["goals"] = goals(report, max(c for c in args.concurrency if c <= 32))
    (args.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    write_report(report, args.output, name)
    print(json.dumps(report["goals"], indent=2))


def write_report(report: dict[str, Any], output: Path, name: str) -> None:
    plot(report, output / f"{name}.png")
    (output / f"{name}.md").write_text(table(report))


def goals(report: dict[str, Any], clients: int) -> dict[str, Any]:
    http, limit = report["http"], report["in_process"]
    key = str(clients)
    scoring_ratio = (
        http["on"]["logprobs"][key]["requests_per_s"] / limit["logprobs"]["requests_per_s"]
    )
    gen_speedup = (
        http["on"]["generate"][key]["requests_per_s"]
        / http["off"]["generate"][key]["requests_per_s"]
    )
    p50_on, p50_off = (http[m]["logprobs"]["1"]["p50_ms"] for m in ("on", "off"))
    return {
        "clients": clients,
        "scoring_vs_in_process": round(scoring_ratio, 3),
        "scoring_goal_met": scoring_ratio >= 0.7,
        "generation_on_vs_off": round(gen_speedup, 2),
        "generation_goal_met": gen_speedup >= 5,
        "single_client_p50_ms_on_off": [p50_on, p50_off],
        "single_client_goal_met": p50_on <= 1.1 * p50_off + 10,
    }


if __name__ == "__main__":
    main()
