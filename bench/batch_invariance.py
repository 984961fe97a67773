"""Batch-invariant mode: how far a sequence's scores move with what is batched beside it, in
the default mode and in batch-invariant mode (which must be 0.0), how far sampled log-probs
are from /v1/logprobs of the same tokens, and what the mode costs in throughput, in float32
and bfloat16. The server runs in this process (the ASGI app, no HTTP socket): the figures are
the model calls', not the network's.

    .venv/bin/python bench/batch_invariance.py            # SmolLM2-135M-Instruct
    .venv/bin/python bench/batch_invariance.py --quick    # smoke run on the tiny model

Scores: 32 sequences of 8 to 160 tokens; each of the first four is scored alone, then first in
a request of 8 and of 32 (the others padded to the longest), and beside 7 concurrent
requests. Throughput: the 32 sequences in one request, and 8 concurrent generation requests
of one prompt each (48 new tokens past end-of-sequence).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from common import bench_arguments, in_process

from app.config import Settings
from app.config_groups import DEFAULT_MODEL


@asynccontextmanager
async def served(
    model: str, dtype: str, output: Path, device: str = "cpu"
) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(
        models={
            "model": model,
            "dtype": dtype,
            "device": device,
            "load_reference": False,
            "backend": "transformers",
        },
        storage={"data_dir": output / ".data" / f"invariance-{dtype}"},
        limits={"max_items_per_request": 64},
    )
    async with in_process(settings) as client:
        yield client


async def scores(
    client: httpx.AsyncClient, sequences: list[list[int]], invariant: bool
) -> list[list[float]]:
    body = {"tokens": sequences, "batch_invariant": invariant}
    response = await client.post("/v1/logprobs", json=body)
    response.raise_for_status()
    return [o["log_probs"]["full"] for o in response.json()["outputs"]]


def gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


async def score_gaps(
    client: httpx.AsyncClient, work: list[list[int]], invariant: bool
) -> dict[str, float]:
    """Max abs difference of each of the first four sequences alone vs in larger batches."""
    gaps = {"batch_8": 0.0, "batch_32": 0.0, "beside_7_requests": 0.0}
    for i in range(4):
        others = work[:i] + work[i + 1 :]
        (alone,) = await scores(client, [work[i]], invariant)
        for size in (8, 32):
            (batched, *_) = await scores(client, [work[i], *others[: size - 1]], invariant)
            gaps[f"batch_{size}"] = max(gaps[f"batch_{size}"], gap(alone, batched))
        beside = [scores(client, others[4 * j : 4 * j + 4], invariant) for j in range(7)]
        ((concurrent,), *_) = await asyncio.gather(scores(client, [work[i]], invariant), *beside)
        gaps["beside_7_requests"] = max(gaps["beside_7_requests"], gap(alone, concurrent))
    return gaps


async def generate(
    client: httpx.AsyncClient, prompt: list[int], new: int, seed: int, invariant: bool
) -> list[Any]:
    body = {
        "tokens": [prompt],
        "max_tokens": new,
        "ignore_eos": True,
        "seed": seed,
        "batch_invariant": invariant,
    }
    response = await client.post("/v1/generate", json=body)
    response.raise_for_status()
    sample = response.json()["outputs"][0][0]
    return [sample["tokens"]["response"], sample["log_probs"]["response"]]


async def sampled_gap(
    client: httpx.AsyncClient, prompts: list[list[int]], invariant: bool
) -> float:
    """Max abs difference of sampled log-probs vs /v1/logprobs of the same tokens."""
    worst = 0.0
    rows = await asyncio.gather(
        *(generate(client, p, 16, k, invariant) for k, p in enumerate(prompts))
    )
    for prompt, (tokens, log_probs) in zip(prompts, rows, strict=True):
        (full,) = await scores(client, [prompt + tokens], invariant)
        worst = max(worst, gap(full[len(prompt) :], log_probs))
    return worst


async def throughput(
    client: httpx.AsyncClient,
    work: list[list[int]],
    prompts: list[list[int]],
    new: int,
    reps: int,
    invariant: bool,
) -> dict[str, float]:
    await scores(client, work, invariant)  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        await scores(client, work, invariant)
    scored = reps * sum(len(s) for s in work) / (time.perf_counter() - start)
    await generate(client, prompts[0], 2, 0, invariant)
    start = time.perf_counter()
    await asyncio.gather(*(generate(client, p, new, k, invariant) for k, p in enumerate(prompts)))
    generated = len(prompts) * new / (time.perf_counter() - start)
    return {"score_tok_s": round(scored, 1), "generate_tok_s": round(generated, 1)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    longest = 40 if args.quick else 160
    work = [
        [
            rng.randrange(10, 5000 if not args.quick else 250)
            for _ in range(rng.randrange(8, longest + 1))
        ]
        for _ in range(32)
    ]
    prompts = [s[:24] for s in work[:8]]
    new, reps = (8, 1) if args.quick else (48, 3)
    report: dict[str, Any] = {"model": args.model, "sequences": f"32, 8 to {longest} tokens"}
    for dtype in args.dtypes:
        async with served(args.model, dtype, args.output, args.device) as client:
            figures: dict[str, Any] = {}
            for mode, invariant in (("default", False), ("invariant", True)):
                figures[mode] = {
                    "score_gap_alone_vs": await score_gaps(client, work, invariant),
                    "sampled_vs_scored_gap": await sampled_gap(client, prompts[:4], invariant),
                    **await throughput(client, work, prompts, new, reps, invariant),
                }
            for key in ("score_tok_s", "generate_tok_s"):
                figures[f"invariant_{key}_share"] = round(
                    figures["invariant"][key] / figures["default"][key], 3
                )
            report[dtype] = figures
            print(dtype, json.dumps(figures, indent=1), flush=True)
    return report


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--model", default=None, help="default: SmolLM2 (tiny with --quick)")
    parser.add_argument("--device", default="cpu", help="the server's (cuda: bench/gpu_check.py)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16"],
        help="bfloat16 on a CPU without bf16 matrix units is slow (minutes per figure)",
    )
    args = parser.parse_args()
    args.model = args.model or ("builtin:tiny" if args.quick else DEFAULT_MODEL)
    report = asyncio.run(run(args))
    args.output.mkdir(parents=True, exist_ok=True)
    name = "batch_invariance-quick.json" if args.quick else "batch_invariance.json"
    (args.output / name).write_text(json.dumps(report, indent=2) + "\n")
    for dtype in args.dtypes:
        invariant = report[dtype]["invariant"]
        assert all(v == 0.0 for v in invariant["score_gap_alone_vs"].values()), invariant
        assert invariant["sampled_vs_scored_gap"] == 0.0, invariant


if __name__ == "__main__":
    main()
