"""GRPO with generation ahead of the trainer: `max_staleness` 0, 1 and 2 on the same budget.

Each run is examples/grpo.py (SmolLM2-135M-Instruct, the bundled addition task, the same
hyper-parameters and seeds, the decoupled-PPO loss) against a fresh server, differing only in
`--max-staleness`. Synchronous training runs twice, with two seeds, for the run-to-run noise.
Per run it reports reward per step, steps/s, the time the trainer waited for data, and the
share of samples dropped or regenerated for being over the bound.

On one 2-core machine the trainer and the server share the cores, so sampling ahead mostly
takes cores from the trainer. The second part times a few steps of equal work (every reply
`max_new_tokens` long) for each bound on a quiet machine. The third shows what overlap does
when they do not share: the trainer's step is a sleep of `--simulated-train-s` (a trainer on
another device: no CPU used here) and the weights it pushes are unchanged; steps/s for each
bound.

    .venv/bin/python bench/async_training.py              # about 45 minutes here
    .venv/bin/python bench/async_training.py --parts equal_work   # only the timed steps
    .venv/bin/python bench/async_training.py --quick      # built-in model, 2 steps a run
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import bench_arguments, reward_plot, running_server, standard_error
from rlserve_client import Client
from rlserve_client.async_collector import AsyncCollector

from app.config_groups import DEFAULT_MODEL
from examples.grpo import arguments, train


def server_env(output: Path) -> dict[str, str]:
    return {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }


def learning_run(model: str, argv: list[str], output: Path, name: str) -> list[dict[str, Any]]:
    """examples/grpo.py's loop with `argv`, against a server started for it."""
    args = arguments(argv)
    log = output / f"async-training-{name}.log"
    records = []
    with (
        running_server("--model", model, env=server_env(output), log=log, ready_timeout=600) as s,
        Client(base_url=s.url, timeout=600) as client,
    ):
        for record in train(client, args):
            print(name, json.dumps(record), flush=True)
            records.append(record)
    return records


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    """Reward at the start and the end (each third's mean and the standard error of its step
    means), speed, waiting, and the samples over the bound."""
    rewards = [r["reward"] for r in records]
    third = max(len(rewards) // 3, 1)
    first, last = rewards[:third], rewards[-third:]
    wall = sum(r["step_s"] for r in records)
    samples = sum(r["samples"] for r in records)
    over = sum(r["dropped"] + r["regenerated"] for r in records)
    return {
        "steps": len(records),
        "samples": samples,
        "mean_reward": statistics.fmean(rewards),
        "first_third_reward": statistics.fmean(first),
        "last_third_reward": statistics.fmean(last),
        "last_third_reward_sem": standard_error(last),
        "steps_per_s": len(records) / wall,
        "wall_s": wall,
        "wait_s": sum(r["wait_s"] for r in records),
        "train_s": sum(r["train_s"] for r in records),
        "push_s": sum(r["push_s"] for r in records),
        "staleness_mean": statistics.fmean(r["staleness_mean"] for r in records),
        "dropped": sum(r["dropped"] for r in records),
        "regenerated": sum(r["regenerated"] for r in records),
        "over_bound_share": over / max(samples + over, 1),
        "max_weight": max(r["max_weight"] for r in records),
    }


def overlap_run(model: str, bound: int, steps: int, train_s: float, output: Path) -> dict[str, Any]:
    """Steps/s with a trainer that uses no CPU here: it sleeps `train_s` and pushes the weights
    it started from (the push still pauses the server and bumps the version)."""
    import torch
    from transformers import AutoModelForCausalLM

    log = output / f"async-training-overlap-{bound}.log"
    with (
        running_server("--model", model, env=server_env(output), log=log, ready_timeout=600) as s,
        Client(base_url=s.url, timeout=600) as client,
    ):
        source = next(m.source for m in client.models().models if m.name == "policy")
        weights = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        env = {"dataset": "addition", "reward": "number", "repeats": 8, "max_turns": 1}
        generation = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
        ahead = AsyncCollector(
            client,
            env=env,
            num_episodes=32,
            generation=generation,
            max_staleness=bound,
            seed=7,
        )
        with client.weight_transfer() as sync, ahead:
            started = None
            for k, _batch in enumerate(ahead.batches(steps + 1)):
                if k == 1:  # the first step warms up
                    started = time.perf_counter()
                time.sleep(train_s)
                sync.send(weights)
            assert started is not None
            wall = time.perf_counter() - started
        stats = ahead.stats.as_dict()
    return {
        "max_staleness": bound,
        "steps": steps,
        "steps_per_s": steps / wall,
        "wait_s": stats["wait_s"],
        "staleness": stats["staleness"],
        "dropped": stats["dropped"],
        "regenerated": stats["regenerated"],
    }


def table(runs: dict[str, dict[str, float]]) -> str:
    lines = [
        "| run | steps/s | trainer waits (s) | mean staleness | dropped / regenerated | "
        "reward (mean) | reward (last third ± sem) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in runs.items():
        lines.append(
            f"| {name} | {s['steps_per_s']:.4f} | {s['wait_s']:.0f} | {s['staleness_mean']:.2f} "
            f"| {s['dropped']} / {s['regenerated']} | {s['mean_reward']:.3f} "
            f"| {s['last_third_reward']:.3f} ± {s['last_third_reward_sem']:.3f} |"
        )
    return "\n".join(lines)


def equal_work(model: str, bound: int, steps: int, output: Path) -> dict[str, float]:
    """Steps/s of the real loop with every reply `max_new_tokens` long (the same work each
    step, whatever the policy writes); the first step, a warm-up, is left out."""
    argv = ["--steps", str(steps + 1), "--max-staleness", str(bound), "--fixed-length"]
    records = learning_run(model, argv, output, f"equal-work-{bound}")[1:]
    wall = sum(r["step_s"] for r in records)
    return {
        "max_staleness": bound,
        "steps": len(records),
        "steps_per_s": len(records) / wall,
        "wait_s": statistics.fmean(r["wait_s"] for r in records),
        "train_s": statistics.fmean(r["train_s"] for r in records),
        "push_s": statistics.fmean(r["push_s"] for r in records),
    }


PARTS = ("learning", "equal_work", "overlap")


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--equal-work-steps", type=int, default=5)
    parser.add_argument("--overlap-steps", type=int, default=6)
    parser.add_argument("--simulated-train-s", type=float, default=4.0)
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="which parts to run; the others are kept from an earlier report in --output",
    )
    options = parser.parse_args()
    output: Path = options.output
    output.mkdir(parents=True, exist_ok=True)
    parts = options.parts.split(",")
    model = "builtin:tiny" if options.quick else DEFAULT_MODEL
    steps = 2 if options.quick else options.steps
    short = 2 if options.quick else options.overlap_steps
    equal_steps = 1 if options.quick else options.equal_work_steps
    train_s = 0.2 if options.quick else options.simulated_train_s
    stem = "async_training-quick" if options.quick else "async_training"
    path = output / f"{stem}.json"
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    report["model"] = model
    report["hyper_parameters"] = {k: v for k, v in vars(arguments([])).items() if k != "url"}
    if "learning" in parts:
        plan = {"staleness 0": (0, 0), "staleness 0, seed 1": (0, 1), "staleness 1": (1, 0)}
        plan["staleness 2"] = (2, 0)
        curves = {}
        for name, (bound, seed) in plan.items():
            argv = ["--steps", str(steps), "--max-staleness", str(bound), "--seed", str(seed)]
            tag = name.replace(" ", "").replace(",", "-")
            curves[name] = learning_run(model, argv, output, tag)
        report["summary"] = {name: summary(records) for name, records in curves.items()}
        report["steps"] = curves
    if "equal_work" in parts:
        report["equal_work"] = [equal_work(model, b, equal_steps, output) for b in (0, 1, 2)]
    if "overlap" in parts:
        runs = [overlap_run(model, b, short, train_s, output) for b in (0, 1, 2)]
        report["overlap"] = {"simulated_train_s": train_s, "runs": runs}
    path.write_text(json.dumps(report, indent=2) + "\n")
    (output / f"{stem}.md").write_text(table(report["summary"]) + "\n")
    reward_plot(
        report["steps"],
        output / f"{stem}.png",
        title="SmolLM2-135M-Instruct, addition, 2-core CPU: staleness bound",
        xlabel="GRPO step (32 samples each)",
    )
    print(table(report["summary"]))
    print(json.dumps({k: report.get(k) for k in ("equal_work", "overlap")}, indent=2))


if __name__ == "__main__":
    main()
