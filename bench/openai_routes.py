"""What the OpenAI layer costs: /v1/chat/completions against /v1/generate on the same load
(the same chat prompts, seeds and lengths), and, with the vLLM backend, against `vllm serve`'s
own /v1/chat/completions on the same model and engine options.

    python bench/openai_routes.py                      # transformers backend
    .venv-vllm/bin/python bench/openai_routes.py --vllm # also vLLM: rlserve vs vllm serve
    python bench/openai_routes.py --quick              # smoke run

Streaming: the median time to the first content chunk at the same concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from common import (
    bench_arguments,
    bench_model,
    drive,
    free_port,
    running_process,
    running_server,
    save_report,
    vllm_serve_command,
)

KV_CACHE_BYTES = 1 << 30


def chats(count: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Question {i}: what comes after {i}?"}] for i in range(count)
    ]


def bodies(kind: str, args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    out = []
    for i, chat in enumerate(chats(args.requests)):
        if kind == "generate":
            body: dict[str, Any] = {"messages": [chat], "max_tokens": args.new_tokens}
        else:
            body = {"model": model, "messages": chat, "max_tokens": args.new_tokens}
        out.append({**body, "seed": i, "ignore_eos": True})
    return out


async def first_chunk(url: str, work: list[dict[str, Any]], clients: int) -> float:
    """Median seconds from sending a streamed chat request to its first content chunk."""
    waits: list[float] = []
    queue = list(reversed(work))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                body = {**queue.pop(), "stream": True}
                start = time.perf_counter()
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    got = False
                    async for line in response.aiter_lines():
                        if not got and line.startswith("data: {") and '"content":"' in line:
                            chunk = json.loads(line[6:])
                            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                                waits.append(time.perf_counter() - start)
                                got = True

        await asyncio.gather(*(worker() for _ in range(clients)))
    return round(statistics.median(waits) * 1000, 1)


def measure(
    name: str, url: str, routes: dict[str, list[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for clients in args.clients:
        point = {
            kind: asyncio.run(drive(url, route, work, clients, args.new_tokens)).as_dict()
            for kind, (route, work) in routes.items()
        }
        if "chat" in routes:
            point["chat_stream_first_chunk_ms_p50"] = asyncio.run(
                first_chunk(url, routes["chat"][1], clients)
            )
        results[str(clients)] = point
        print(name, clients, point, flush=True)
    return results


def rlserve(args: argparse.Namespace, model_dir: Path, backend: str) -> dict[str, Any]:
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__BACKEND": backend,
        "RLSERVE_MODELS__DTYPE": "float32",
        "RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    routes = {
        "generate": ("/v1/generate", bodies("generate", args, "policy")),
        "chat": ("/v1/chat/completions", bodies("chat", args, "policy")),
    }
    log = args.output / f"rlserve-openai-{backend}.log"
    with running_server("--model", str(model_dir), env=env, log=log, ready_timeout=600) as server:
        return measure(f"rlserve {backend}", server.url, routes, args)


def vllm_serve(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    port = free_port()
    command = vllm_serve_command(model_dir, port, KV_CACHE_BYTES, "policy")
    routes = {"chat": ("/v1/chat/completions", bodies("chat", args, "policy"))}
    log = args.output / "vllm-serve-chat.log"
    with running_process(command, port, "/v1/models", log=log, timeout=600) as server:
        return measure("vllm serve", server.url, routes, args)


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--vllm", action="store_true", help="also the vLLM backend and vllm serve")
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (512, 6)
    args.requests = 16 if args.quick else 128
    args.clients = [8] if args.quick else [8, 32]
    args.new_tokens = 32
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, hidden, layers)
    results: dict[str, Any] = {"transformers": rlserve(args, model_dir, "transformers")}
    if args.vllm:
        results["vllm"] = rlserve(args, model_dir, "vllm")
        results["vllm_serve"] = vllm_serve(args, model_dir)
    ratios: dict[str, Any] = {}
    for backend in ("transformers", "vllm"):
        if backend in results:
            ratios[f"{backend}_chat_over_generate"] = {
                c: round(p["chat"]["requests_per_s"] / p["generate"]["requests_per_s"], 3)
                for c, p in results[backend].items()
            }
    if "vllm_serve" in results:
        ratios["rlserve_vllm_chat_over_vllm_serve_chat"] = {
            c: round(
                p["chat"]["requests_per_s"] / results["vllm_serve"][c]["chat"]["requests_per_s"], 3
            )
            for c, p in results["vllm"].items()
        }
    report = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, CPU",
        "workload": {"requests_per_point": args.requests, "new_tokens": args.new_tokens},
        "results": results,
        "ratios": ratios,
        "goals": {
            "openai_layer_costs_at_most_10_percent": all(
                r >= 0.9
                for key, v in ratios.items()
                if key.endswith("over_generate")
                for r in v.values()
            )
        },
    }
    save_report(args, "openai_routes", report)
    print(json.dumps({"ratios": ratios, "goals": report["goals"]}, indent=2))


if __name__ == "__main__":
    main()
