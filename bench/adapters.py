"""LoRA adapters: scoring and generation throughput with 1, 4 and 16 adapters resident, their
requests spread over the adapters (so batches mix them), against the policy alone; the
policy's own throughput with 16 adapters resident (what idle hooks cost); and how long loading
an adapter takes (serving never pauses for it). In this process (the ASGI app, no HTTP
socket): the figures are the model calls'.

    .venv/bin/python bench/adapters.py            # SmolLM2-135M-Instruct, rank 16, every layer
    .venv/bin/python bench/adapters.py --quick    # smoke run on the tiny model
    .venv-vllm/bin/python bench/adapters.py --backend vllm    # vLLM's LoRA layers

On vLLM the engine serves adapters with its LoRA layers on (RLSERVE_VLLM__MAX_LORAS, as many
as the most resident here); `base_alone` is an engine with them off, and
`base_with_lora_layers` the policy alone on the engine with them on (what they cost).

Scoring: 32 sequences of 8 to 160 tokens, as 8 concurrent requests of 4. Generation: 16
concurrent requests of one prompt each, 48 new tokens past end-of-sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
from common import bench_arguments, in_process
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.config_groups import DEFAULT_MODEL

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@asynccontextmanager
async def served(
    model: str, output: Path, backend: str = "transformers", max_loras: int = 0, device: str = "cpu"
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        models={"model": model, "load_reference": False, "backend": backend, "device": device},
        storage={"data_dir": output / ".data" / "adapters"},
        limits={"max_items_per_request": 64},
        vllm={"kv_cache_memory_bytes": 1 << 30, "max_loras": max_loras, "max_lora_rank": 16},
    )
    async with in_process(settings) as client:
        yield client


def save_adapters(source: str, count: int, rank: int, into: Path) -> list[Path]:
    """`count` random adapters of the policy (PEFT, rank `rank` on every linear layer)."""
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights="gaussian"
    )
    folders = []
    for k in range(count):
        torch.manual_seed(k)
        get_peft_model(copy.deepcopy(base), config).save_pretrained(into / f"a{k}")
        folders.append(into / f"a{k}")
    return folders


async def post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> Any:
    response = await client.post(route, json=body)
    response.raise_for_status()
    return response.json()


async def throughput(
    client: httpx.AsyncClient,
    models: list[str],
    work: list[list[int]],
    prompts: list[list[int]],
    new: int,
    reps: int,
) -> dict[str, float]:
    """Tokens per second, request k naming models[k % len(models)]."""

    def model(k: int) -> str:
        return models[k % len(models)]

    async def score_all() -> None:
        await asyncio.gather(
            *(
                post(client, "/v1/logprobs", {"model": model(k), "tokens": work[4 * k : 4 * k + 4]})
                for k in range(len(work) // 4)
            )
        )

    await score_all()  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        await score_all()
    scored = reps * sum(len(s) for s in work) / (time.perf_counter() - start)
    body = {"max_tokens": new, "ignore_eos": True, "seed": 0}
    await post(client, "/v1/generate", {**body, "model": model(0), "tokens": [prompts[0]]})
    start = time.perf_counter()
    await asyncio.gather(
        *(
            post(client, "/v1/generate", {**body, "model": model(k), "tokens": [p]})
            for k, p in enumerate(prompts)
        )
    )
    generated = len(prompts) * new / (time.perf_counter() - start)
    return {"score_tok_s": round(scored, 1), "generate_tok_s": round(generated, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    longest, vocab = (40, 250) if args.quick else (160, 5000)
    work = [
        [rng.randrange(10, vocab) for _ in range(rng.randrange(8, longest + 1))] for _ in range(32)
    ]
    prompts = [s[:24] for s in work[:16]]
    new, reps = (8, 1) if args.quick else (48, 2)
    counts = [1, 4] if args.quick else [1, 4, 16]
    report: dict[str, Any] = {
        "model": args.model,
        "backend": args.backend,
        "rank": args.rank,
        "targets": TARGETS,
    }
    vllm = args.backend == "vllm"
    if vllm:  # the policy on an engine without LoRA layers
        async with served(args.model, args.output, "vllm", device=args.device) as client:
            report["base_alone"] = await throughput(client, ["policy"], work, prompts, new, reps)
            print("base alone", report["base_alone"], flush=True)
    max_loras = max(counts) if vllm else 0
    async with served(args.model, args.output, args.backend, max_loras, args.device) as client:
        source = (await client.get("/v1/models")).json()["data"][0]["source"]
        with tempfile.TemporaryDirectory() as tmp:
            folders = save_adapters(source, max(counts), args.rank, Path(tmp))
            alone = await throughput(client, ["policy"], work, prompts, new, reps)
            report["base_with_lora_layers" if vllm else "base_alone"] = alone
            print("base, on this engine", alone, flush=True)
            loads = []
            for k, folder in enumerate(folders):
                start = time.perf_counter()
                await post(client, "/v1/adapters", {"name": f"a{k}", "path": str(folder)})
                loads.append(time.perf_counter() - start)
                if k + 1 in counts:
                    names = [f"a{j}" for j in range(k + 1)]
                    figures = await throughput(client, names, work, prompts, new, reps)
                    report[f"{k + 1}_adapters"] = figures
                    print(k + 1, "adapters", figures, flush=True)
            report[f"base_beside_{max(counts)}_resident"] = await throughput(
                client, ["policy"], work, prompts, new, reps
            )
            info = (await client.get("/v1/adapters")).json()["adapters"][0]
    report["adapter_parameters"] = info["num_parameters"]
    report["load_ms"] = {
        "median": round(sorted(loads)[len(loads) // 2] * 1000, 1),
        "max": round(max(loads) * 1000, 1),
    }
    for key, figures in list(report.items()):
        if key.endswith("adapters") or key.startswith(("base_beside", "base_with")):
            for name in ("score_tok_s", "generate_tok_s"):
                share = figures[name] / report["base_alone"][name]
                figures[f"{name}_vs_base"] = round(share, 3)
    return report


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2 (tiny with --quick)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--device", default="cpu", help="the server's (cuda: bench/gpu_check.py)")
    args = parser.parse_args()
    args.model = args.model or ("builtin:tiny" if args.quick else DEFAULT_MODEL)
    report = asyncio.run(run(args))
    print(json.dumps(report, indent=1))
    args.output.mkdir(parents=True, exist_ok=True)
    name = "adapters" + ("-vllm" if args.backend == "vllm" else "")
    name += "-quick.json" if args.quick else ".json"
    (args.output / name).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
