"""Weight sync to one server and to 2 replicas on Ray Serve: a path load and a collective
transfer (gloo) of the whole policy, each a few times; sessions of the replicas in a
redis-server; transformers backend, this CPU. On the one server also a LoRA adapter's push
(rank 16 on every linear layer), by upload and over the transfer, each a new version of it.

    python bench/weight_sync.py          # 512-wide 6-layer built-in model
    python bench/weight_sync.py --quick  # smoke run

Per update: the seconds the trainer waited, the seconds serving paused for the swap (the
server's `seconds`), and the version every replica then serves."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    bench_arguments,
    bench_model,
    free_port,
    ray_serve_env,
    running_process,
    running_server,
    save_report,
    wait_for_replicas,
)

from tests.stores.redis_server import running_redis


def updates(url: str, model_dir: Path, repeats: int) -> dict[str, Any]:
    import torch
    from rlserve_client import Client
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {k: v * 0.99 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    checkpoint = model_dir.parent / f"{model_dir.name}-update.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint))
    out: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in state.values())}
    with Client(base_url=url, max_retries=0, timeout=600) as client:
        timed: dict[str, list[tuple[float, float, int]]] = {"load": [], "transfer": []}
        for _ in range(repeats):
            start = time.perf_counter()
            done = client.load_weights(path=str(checkpoint))
            timed["load"].append((time.perf_counter() - start, done.seconds, done.policy_version))
        with client.weight_transfer(master_address="127.0.0.1", timeout_s=300) as sync:
            for _ in range(repeats):
                start = time.perf_counter()
                done = sync.send(state)
                took = time.perf_counter() - start
                timed["transfer"].append((took, done.seconds, done.policy_version))
        for kind, runs in timed.items():
            out[kind] = {
                "runs": len(runs),
                "median_s": round(statistics.median(r[0] for r in runs), 3),
                "paused_median_s": round(statistics.median(r[1] for r in runs), 3),
                "gb_per_s": round(out["bytes"] / statistics.median(r[0] for r in runs) / 1e9, 3),
                "versions": [r[2] for r in runs],
            }
    checkpoint.unlink()
    return out


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapter_pushes(url: str, model_dir: Path, repeats: int) -> dict[str, Any]:
    """A trainer's push of its adapter each step: by upload (`client.push_adapter`, the file
    made from the PEFT model each time) and over the transfer (`sync.send_adapter`)."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from rlserve_client import Client
    from rlserve_client.lora import adapter_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    adapter = get_peft_model(base, config)
    tensors = get_peft_model_state_dict(adapter)
    out: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    with Client(base_url=url, max_retries=0, timeout=600) as client:
        timed: dict[str, list[tuple[float, int]]] = {"upload": [], "transfer": []}
        for _ in range(repeats):
            start = time.perf_counter()
            pushed = client.push_adapter(name="bench", payload=adapter_file(adapter))
            timed["upload"].append((time.perf_counter() - start, pushed.version))
        with client.weight_transfer(master_address="127.0.0.1", timeout_s=300) as sync:
            for _ in range(repeats):
                start = time.perf_counter()
                sent = sync.send_adapter(adapter, "bench")
                took = time.perf_counter() - start
                timed["transfer"].append((took, sent.adapter_version or 0))
    for kind, runs in timed.items():
        out[kind] = {
            "runs": len(runs),
            "median_ms": round(statistics.median(r[0] for r in runs) * 1000, 1),
            "versions": [r[1] for r in runs],
        }
    return out


def main() -> None:
    parser = bench_arguments(__doc__)
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (512, 6)
    repeats = 2 if args.quick else 5
    args.output.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.output, hidden, layers)
    env = ray_serve_env(args.output)
    results = {}
    with running_server(
        "--model", str(model_dir), env=env, log=args.output / "plain.log", ready_timeout=600
    ) as plain:
        results["plain"] = updates(plain.url, model_dir, repeats)
        print("plain", results["plain"], flush=True)
        results["plain_adapter"] = adapter_pushes(plain.url, model_dir, repeats)
        print("plain, an adapter", results["plain_adapter"], flush=True)
    with running_redis(args.output / ".data") as redis_url:
        port = free_port()
        command = [sys.executable, "-m", "app.cli", "serve", "--replicas", "2"]
        command += ["--port", str(port), "--model", str(model_dir)]
        log = args.output / "ray-serve.log"
        replicas_env = {**env, "RLSERVE_STORAGE__SESSION_STORE": redis_url}
        with running_process(command, port, "/ready", env=replicas_env, log=log, timeout=600) as s:
            wait_for_replicas(s.url, 2, timeout=600)
            results["ray_serve_2_replicas"] = updates(s.url, model_dir, repeats)
            print("ray serve", results["ray_serve_2_replicas"], flush=True)
    report = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, transformers, CPU",
        "host": "2 CPU cores, no GPU; the replicas share them with Ray's own processes",
        "results": results,
    }
    save_report(args, "weight_sync", report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
