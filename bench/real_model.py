"""Throughput on the default model (SmolLM2-135M-Instruct, float32): rlserve against
transformers in-process and against `vllm serve`, on the same prompts and sequences.

    .venv/bin/python bench/real_model.py                 # rlserve (transformers) and in-process
    .venv-vllm/bin/python bench/real_model.py --vllm     # also rlserve (vLLM) and vllm serve
    .venv/bin/python bench/real_model.py --quick         # smoke run

Generation: chat prompts (about 30 tokens) as token ids, `new_tokens` sampled at temperature 1
past end-of-sequence, one sequence per request from concurrent clients; in-process, the same
prompts in batches of `clients` through `generate`. Scoring: 128-token sequences of real
text, one per request; in-process, batches of `clients` through one forward and a log-softmax.
With --vllm, the bodies sent to `vllm serve` (/v1/completions, scoring by `prompt_logprobs`)
are also sent to rlserve's /v1/completions on the vLLM backend; `vllm serve` runs twice, with
the engine options rlserve gives vLLM on this platform (on CPU, no chunked prefill) and with
vLLM's own defaults.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from common import bench_arguments as arguments
from common import (
    free_port,
    running_process,
    running_server,
    save_report,
    throughput_ratios,
    vllm_serve_command,
)
from vs_vllm_serve import measure, rlserve_bodies, vllm_bodies

from app.config import Settings
from app.config_groups import DEFAULT_MODEL
from app.datasets.bundled import arithmetic_problems
from app.engine.loader import smollm2_dir

KV_CACHE_BYTES = 1 << 30
SCORE_TOKENS = 128


def workloads(tokenizer: Any, num_requests: int) -> dict[str, list[list[int]]]:
    problems = arithmetic_problems(num_requests, seed=1)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.query}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for p in problems
    ]
    text = " ".join(p.query + " " + (p.answer or "") for p in arithmetic_problems(400, seed=2))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    sequences = [ids[i * SCORE_TOKENS : (i + 1) * SCORE_TOKENS] for i in range(num_requests)]
    assert all(len(s) == SCORE_TOKENS for s in sequences), "not enough text to score"
    return {"generate": prompts, "score": sequences}


@torch.inference_mode()
def in_process(model: Any, work: dict[str, list[list[int]]], args: argparse.Namespace) -> Any:
    """The same work through transformers directly, `clients` sequences per call."""
    pad = model.generation_config.pad_token_id
    results = {}
    for clients in args.clients:
        figures: dict[str, Any] = {}
        for kind, rows in work.items():
            started = time.perf_counter()
            for at in range(0, len(rows), clients):
                batch = rows[at : at + clients]
                width = max(map(len, batch))
                ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch])
                mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
                ids, mask = ids.to(model.device), mask.to(model.device)
                if kind == "generate":
                    model.generate(
                        input_ids=ids,
                        attention_mask=mask,
                        do_sample=True,
                        top_k=0,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                        pad_token_id=pad,
                    )
                else:
                    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                    logits.gather(-1, ids[:, 1:, None]) - logits.logsumexp(-1, keepdim=True)
            if model.device.type == "cuda":
                torch.cuda.synchronize(model.device)
            seconds = time.perf_counter() - started
            per = args.new_tokens if kind == "generate" else SCORE_TOKENS
            figures[kind] = {
                "requests": len(rows),
                "seconds": round(seconds, 3),
                "requests_per_s": round(len(rows) / seconds, 3),
                "tokens_per_s": round(len(rows) * per / seconds, 3),
            }
        results[str(clients)] = figures
        print("in-process", clients, json.dumps(figures), flush=True)
    return results


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--vllm", action="store_true", help="also the vLLM backend and vllm serve")
    args = parser.parse_args()
    args.requests = 16 if args.quick else 64
    args.clients = [8] if args.quick else [8, 32]
    args.new_tokens = 8 if args.quick else 32
    args.seq_len = SCORE_TOKENS
    args.output.mkdir(parents=True, exist_ok=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir: Path = smollm2_dir(Settings().models)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    work = workloads(tokenizer, args.requests)
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_VLLM__KV_CACHE_MEMORY_BYTES": str(KV_CACHE_BYTES),
    }
    results: dict[str, Any] = {}
    backends = ["transformers", "vllm"] if args.vllm else ["transformers"]
    for backend in backends:
        log = args.output / f"real-model-rlserve-{backend}.log"
        env["RLSERVE_MODELS__BACKEND"] = backend
        with running_server(
            "--model", DEFAULT_MODEL, env=env, log=log, ready_timeout=600
        ) as server:
            bodies = rlserve_bodies(work, args.new_tokens)
            results[f"rlserve_{backend}"] = measure(f"rlserve {backend}", server.url, bodies, args)
            if backend == "vllm":  # the very bodies sent to vllm serve, to vLLM's own route
                same = vllm_bodies(work, args.new_tokens, "policy")
                results["rlserve_vllm_completions"] = measure(
                    "rlserve vllm /v1/completions", server.url, same, args
                )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results["in_process_transformers"] = in_process(model, work, args)
    del model
    if args.vllm:
        # with the engine options rlserve gives vLLM here, then with vLLM's own defaults
        for name, defaults in (("vllm_serve", False), ("vllm_serve_defaults", True)):
            port = free_port()
            command = vllm_serve_command(
                model_dir,
                port,
                KV_CACHE_BYTES,
                "policy",
                "--max-logprobs",
                "1",
                vllm_defaults=defaults,
            )
            log = args.output / f"real-model-{name.replace('_', '-')}.log"
            with running_process(command, port, "/v1/models", log=log, timeout=600) as server:
                bodies = vllm_bodies(work, args.new_tokens, "policy")
                results[name] = measure(name.replace("_", " "), server.url, bodies, args)
    kinds = ("generate", "score")
    ratios = {
        "rlserve_transformers_over_in_process": throughput_ratios(
            results["rlserve_transformers"], results["in_process_transformers"], kinds
        )
    }
    if args.vllm:
        for name in ("rlserve_transformers", "rlserve_vllm", "rlserve_vllm_completions"):
            for serve in ("vllm_serve", "vllm_serve_defaults"):
                ratios[f"{name}_over_{serve}"] = throughput_ratios(
                    results[name], results[serve], kinds
                )
    report = {
        "model": "SmolLM2-135M-Instruct, float32, CPU (2 cores)",
        "workload": {
            "requests_per_point": args.requests,
            "generate_new_tokens": args.new_tokens,
            "score_tokens": SCORE_TOKENS,
        },
        "results": results,
        "ratios": ratios,
    }
    save_report(args, "real_model", report)
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
