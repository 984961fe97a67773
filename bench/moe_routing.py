"""Routing replay on a mixture-of-experts model: how often a trainer's forward routes the
sampled tokens to other experts than the sampler did, and how far its log-probs then are from
the sampler's, without and with replay (`rlserve_client.moe.replay_experts`), in float32 and
bfloat16. The server runs in this process (the ASGI app, no HTTP socket).

    .venv/bin/python bench/moe_routing.py            # two random Qwen3-MoE models, below
    .venv/bin/python bench/moe_routing.py --quick    # smoke run on builtin:tiny-moe

The models (random weights, hidden size 256, 4 layers, 64 experts, top 8): as initialised
("peaked": random routers are confident), and with the router weights scaled by 0.1 ("flat":
near-uniform router probabilities, where near ties are common, as in trained MoE models whose
routers spread tokens evenly). Each router's mean entropy is reported against its maximum,
log(64).

The sampler: /v1/generate, 16 prompts of 8 to 48 tokens in one request, 32 new tokens each
(sampled at temperature 1, past end-of-sequence), with return_routed_experts. The trainer: a
plain transformers forward of the same model in the same dtype over all 16 sequences at once,
right-padded (a trainer's layout, not the sampler's left-padded, cached decode). Its routing is
recorded (`rlserve_client.moe.Routing`) and compared token by token with the sampler's; its
log-probs of the sampled tokens are compared with the sampler's, then again with the sampler's
routing replayed. /v1/logprobs with routed_experts gives the server's own recomputation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import torch
from common import bench_arguments, in_process
from rlserve_client.moe import Routing, replay_experts
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.engine.builtin_model import build_model
from app.engine.loader import builtin_moe_dir

NUM_PROMPTS, NEW_TOKENS = 16, 32


def settings(model: Path, dtype: str, output: Path, device: str = "cpu") -> Settings:
    return Settings(
        models={
            "model": str(model),
            "dtype": dtype,
            "device": device,
            "cache_dir": output / ".models",
            "load_reference": False,
            "backend": "transformers",
        },
        storage={"data_dir": output / ".data" / f"moe-{dtype}"},
        limits={"max_items_per_request": 64},
    )


def bench_moe(output: Path, router_scale: float) -> Path:
    """A random Qwen3-MoE of benchmark size, its routers scaled, built once into `output`."""
    path = output / f".moe-h256-l4-e64-k8-r{router_scale}"
    if not (path / "config.json").exists():
        build_model(path, hidden_size=256, num_layers=4, moe=True, num_experts=64, top_k=8)
        if router_scale != 1.0:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            with torch.no_grad():
                for router in (m for m in model.modules() if hasattr(m, "top_k")):
                    router.weight.mul_(router_scale)
            model.save_pretrained(path)
    return path


def router_entropy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean entropy (nats) of the routers' probabilities over the batch's real tokens."""
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
    keep = mask.flatten().bool()
    values = []
    for logits in out.router_logits:
        probs = logits.float().softmax(-1)[keep]
        values.append(float(-(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()))
    return round(sum(values) / len(values), 3)


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


def response_log_probs(logits: torch.Tensor, samples: list[dict[str, Any]]) -> list[torch.Tensor]:
    out = []
    for i, sample in enumerate(samples):
        num_prompt, response = len(sample["tokens"]["prompt"]), sample["tokens"]["response"]
        at = torch.arange(num_prompt - 1, num_prompt - 1 + len(response))
        row = logits[i, at].float().log_softmax(-1)
        out.append(row.gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
    return out


def gaps(got: list[torch.Tensor], sampled: list[torch.Tensor]) -> dict[str, float]:
    diff = torch.cat([(g - s).abs() for g, s in zip(got, sampled, strict=True)])
    return {"max": float(diff.max()), "mean": float(diff.mean())}


async def measure(path: Path, dtype: str, output: Path, device: str = "cpu") -> dict[str, Any]:
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 250) for _ in range(rng.randrange(8, 49))] for _ in range(16)]
    configured = settings(path, dtype, output, device)
    async with in_process(configured) as client:
        body = {
            "tokens": prompts,
            "max_new_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "seed": 1,
            "return_routed_experts": True,
        }
        reply = await client.post("/v1/generate", json=body)
        reply.raise_for_status()
        samples = [group[0] for group in reply.json()["outputs"]]
        fulls = [s["tokens"]["full"] for s in samples]
        routed = [torch.tensor(s["routed_experts"]) for s in samples]
        rescored = await client.post(
            "/v1/logprobs", json={"tokens": fulls, "routed_experts": [r.tolist() for r in routed]}
        )
        rescored.raise_for_status()
    sampled = [torch.tensor(s["log_probs"]["response"]) for s in samples]
    server_replay = [
        torch.tensor(o["log_probs"]["full"][len(s["tokens"]["prompt"]) :])
        for o, s in zip(rescored.json()["outputs"], samples, strict=True)
    ]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    ids, mask = (t.to(device) for t in padded(fulls))
    routing = Routing(model)
    with torch.inference_mode(), routing.recording() as recorded:
        logits = model(input_ids=ids, attention_mask=mask).logits.cpu()
        trainer_routing = recorded.take().cpu()
        trainer_routing = trainer_routing.view(len(fulls), ids.shape[1], routing.num_layers, -1)
    routing.close()
    with torch.inference_mode(), replay_experts(model, routed):
        replayed = model(input_ids=ids, attention_mask=mask).logits.cpu()
    layers = routing.moe_layers
    differs = tokens = pairs = pair_differs = 0
    for i, rows in enumerate(routed):
        mine = trainer_routing[i, : len(rows)][:, layers].sort(-1).values
        theirs = rows[:, layers].sort(-1).values
        per_layer = (mine != theirs).any(-1)
        differs += int(per_layer.any(-1).sum())
        tokens += len(rows)
        pair_differs += int(per_layer.sum())
        pairs += per_layer.numel()
    return {
        "router_entropy_nats": router_entropy(model, ids, mask),
        "tokens_fed": tokens,
        "tokens_routed_differently_share": round(differs / tokens, 4),
        "token_layers_routed_differently_share": round(pair_differs / pairs, 4),
        "trainer_gap_without_replay": gaps(response_log_probs(logits, samples), sampled),
        "trainer_gap_with_replay": gaps(response_log_probs(replayed, samples), sampled),
        "server_logprobs_with_replay_gap": gaps(server_replay, sampled),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "work": f"{NUM_PROMPTS} prompts of 8 to 48 tokens, {NEW_TOKENS} new tokens each",
    }
    if args.quick:
        quick = Settings(models={"cache_dir": args.output / ".models"}).models
        models = {"tiny-moe": builtin_moe_dir(quick)}
        report["models"] = "builtin:tiny-moe: hidden 64, 3 layers (2 MoE), 8 experts, top 2"
    else:
        models = {"peaked": bench_moe(args.output, 1.0), "flat": bench_moe(args.output, 0.1)}
        report["models"] = (
            "random Qwen3-MoE, hidden 256, 4 MoE layers, 64 experts, top 8 (max router "
            f"entropy log(64) = {math.log(64):.3f} nats); flat: router weights x0.1"
        )
    for name, path in models.items():
        report[name] = {}
        for dtype in args.dtypes:
            report[name][dtype] = await measure(path, dtype, args.output, args.device)
            print(name, dtype, json.dumps(report[name][dtype], indent=1), flush=True)
    return report


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cpu", help="the server's and the trainer's")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    args.output.mkdir(parents=True, exist_ok=True)
    name = "moe_routing-quick.json" if args.quick else "moe_routing.json"
    (args.output / name).write_text(json.dumps(report, indent=2) + "\n")
    for model in report.values():
        if isinstance(model, dict) and "float32" in model:
            # in float32, replaying the sampled routing leaves float32's arithmetic alone
            assert model["float32"]["server_logprobs_with_replay_gap"]["max"] < 1e-3, model


if __name__ == "__main__":
    main()
