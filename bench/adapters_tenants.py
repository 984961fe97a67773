"""Several trainers at once on one server, each training its own LoRA adapter.

Each trainer is `examples/grpo.py --lora` in a process of its own, with an API key of its own
(the server has one key per trainer, so each adapter belongs to its trainer: no trainer may
push to another's), on the bundled addition task. First one trainer runs alone for a few
steps (its steps/s alone); then all of them run at once against the same server. Prints and
writes each trainer's reward per step, the steps/s of each against the trainer alone, and the
server's memory (its largest resident set while one trainer ran, and while all of them ran)
against that of one server per trainer (each of those would hold at least what the server
held while one trainer ran).

    .venv/bin/python bench/adapters_tenants.py            # 4 trainers x 10 steps, SmolLM2
                                                          # (2 GRPO groups of 8 a step each)
    .venv/bin/python bench/adapters_tenants.py --quick    # 2 trainers x 1 step, tiny model
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import ROOT, PeakRSS, bench_arguments, rss_bytes, running_server

from app.config_groups import DEFAULT_MODEL

EXAMPLE = ROOT / "examples" / "grpo.py"


def run_trainers(
    url: str, keys: list[str], steps: int, flags: list[str], logs: Path, tag: str
) -> list[dict[str, Any]]:
    """One `grpo.py --lora` per key, all at once; each one's records (one per step)."""
    processes, files = [], []
    for i, key in enumerate(keys):
        log = logs / f"{tag}-{i}.jsonl"
        command = [
            *[sys.executable, str(EXAMPLE), "--url", url, "--lora", "--steps", str(steps)],
            *["--lora-name", f"{tag}-trainer-{i}", "--seed", str(i), "--log", str(log), *flags],
        ]
        out = (logs / f"{tag}-{i}.out").open("w")
        env = {**os.environ, "RLSERVE_API_KEY": key}
        processes.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env))
        files.append(log)
    for i, process in enumerate(processes):
        if process.wait(timeout=7200) != 0:
            output = (logs / f"{tag}-{i}.out").read_text()[-3000:]
            raise RuntimeError(f"trainer {tag}-{i} failed:\n{output}")
    return [
        {"records": [json.loads(line) for line in file.read_text().splitlines()]} for file in files
    ]


def summary(run: dict[str, Any]) -> dict[str, Any]:
    records = run["records"]
    step_s = [r["step_s"] for r in records]
    return {
        "reward_per_step": [round(r["reward"], 4) for r in records],
        "step_s_median": round(statistics.median(step_s), 2),
        "steps_per_s": round(1 / statistics.median(step_s), 4),
        "push_s_median": round(statistics.median(r["push_s"] for r in records), 3),
        "adapter_versions": [r["policy_version"] for r in records],
    }


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--trainers", type=int, default=None, help="default: 4 (2 with --quick)")
    parser.add_argument("--steps", type=int, default=None, help="default: 10 (1 with --quick)")
    parser.add_argument("--alone-steps", type=int, default=None, help="default: 3 (1)")
    parser.add_argument("--prompts", type=int, default=2, help="GRPO groups per trainer step")
    args = parser.parse_args()
    trainers = args.trainers or (2 if args.quick else 4)
    steps = args.steps or (1 if args.quick else 10)
    alone_steps = args.alone_steps or (1 if args.quick else 3)
    model = "builtin:tiny" if args.quick else DEFAULT_MODEL
    # 2 prompts x 8 replies x 24 tokens a step (the example's 4 prompts take about 6 GB per
    # trainer: four of them and the server overran this 24 GB machine); tiny for the smoke run
    flags = ["--prompts", "1", "--group-size", "2", "--max-new-tokens", "4"] if args.quick else []
    flags = flags or ["--prompts", str(args.prompts)]
    keys = [f"trainer-{i}-key" for i in range(trainers)]
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch)
        env = {
            "RLSERVE_MODELS__MODEL": model,
            "RLSERVE_MODELS__BACKEND": "transformers",
            "RLSERVE_MODELS__LOAD_REFERENCE": "false",
            "RLSERVE_STORAGE__DATA_DIR": str(logs / "data"),
            "RLSERVE_AUTH__API_KEYS": ",".join(keys),
        }
        with running_server(env=env, log=logs / "server.log", ready_timeout=300) as server:
            pid = server.process.pid
            loaded = rss_bytes(pid)
            started = time.perf_counter()
            with PeakRSS(pid, every_s=0.2) as one:
                alone = run_trainers(server.url, keys[:1], alone_steps, flags, logs, "alone")
            with PeakRSS(pid, every_s=0.2) as many:
                together = run_trainers(server.url, keys, steps, flags, logs, "together")
            seconds = time.perf_counter() - started
    alone_rate = summary(alone[0])["steps_per_s"]
    each = [summary(run) for run in together]
    report = {
        "command": f"bench/adapters_tenants.py{' --quick' if args.quick else ''}: {trainers} "
        f"trainers (examples/grpo.py --lora {' '.join(flags)}, rank 16 on every linear layer, "
        "one API key each) "
        f"at once against one `rlserve serve` on {model} (transformers, float32, no reference "
        f"model), after one trainer alone for {alone_steps} steps",
        "device": "CPU, 2 cores (the trainers and the server share them)",
        "trainers": trainers,
        "steps": steps,
        "alone": summary(alone[0]),
        "together": each,
        "steps_per_s_together_over_alone": [round(e["steps_per_s"] / alone_rate, 3) for e in each],
        "server_rss_loaded_mib": round(loaded / 2**20),
        "server_rss_peak_one_trainer_mib": round(one.peak / 2**20),
        "server_rss_peak_all_trainers_mib": round(many.peak / 2**20),
        "one_server_per_trainer_mib_at_least": round(trainers * one.peak / 2**20),
        "seconds": round(seconds, 1),
    }
    for i, e in enumerate(each):
        print(
            f"trainer {i}: reward per step {e['reward_per_step']}  "
            f"{e['steps_per_s']:.3f} steps/s ({e['step_s_median']} s/step; alone "
            f"{report['alone']['step_s_median']} s/step)"
        )
    print(
        f"server memory: {report['server_rss_peak_all_trainers_mib']} MiB with {trainers} "
        f"trainers' adapters; one server per trainer: at least "
        f"{report['one_server_per_trainer_mib_at_least']} MiB"
    )
    name = "adapters_tenants-quick.json" if args.quick else "adapters_tenants.json"
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / name).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
