"""TorchRL's GRPO loop on rlserve (examples/torchrl_grpo.py): reward per step on the default
model, synchronous and one-step-off (decoupled loss), with KL to the served reference.

Runs in .venv-torchrl (TorchRL's own classes):

    .venv-torchrl/bin/python bench/torchrl_grpo.py              # 24 steps a run (~25 min here)
    .venv-torchrl/bin/python bench/torchrl_grpo.py --quick      # built-in model, 2 steps
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import bench_arguments, reward_plot, running_server, standard_error
from rlserve_client import Client
from tensordict import set_list_to_stack

from app.config_groups import DEFAULT_MODEL
from examples.torchrl_grpo import arguments, train


def run(model: str, argv: list[str], output: Path, name: str) -> list[dict[str, Any]]:
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
    }
    log = output / f"torchrl-grpo-{name}.log"
    records = []
    with (
        running_server("--model", model, env=env, log=log, ready_timeout=600) as server,
        Client(base_url=server.url, timeout=600) as client,
        set_list_to_stack(True),
    ):
        started = time.perf_counter()
        for record in train(client, arguments(argv)):
            record["elapsed_s"] = time.perf_counter() - started
            print(name, json.dumps(record), flush=True)
            records.append(record)
    return records


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    rewards = [r["reward"] for r in records]
    third = max(len(rewards) // 3, 1)
    return {
        "steps": len(records),
        "samples": sum(r["samples"] for r in records),
        "first_third_reward": statistics.fmean(rewards[:third]),
        "last_third_reward": statistics.fmean(rewards[-third:]),
        "last_third_reward_sem": standard_error(rewards[-third:]),
        "steps_per_s": len(records) / records[-1]["elapsed_s"],
        "wait_s": sum(r["wait_s"] for r in records),
        "train_s": sum(r["train_s"] for r in records),
        "push_s": sum(r["push_s"] for r in records),
    }


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=24)
    options = parser.parse_args()
    output: Path = options.output
    output.mkdir(parents=True, exist_ok=True)
    model = "builtin:tiny" if options.quick else DEFAULT_MODEL
    steps = 2 if options.quick else options.steps
    common = ["--steps", str(steps), "--kl-coeff", "0.05"]
    curves = {
        "synchronous": run(model, [*common, "--max-staleness", "0"], output, "sync"),
        "one-step-off": run(model, [*common, "--max-staleness", "1"], output, "async"),
    }
    report = {
        "model": model,
        "hyper_parameters": {k: v for k, v in vars(arguments(common)).items() if k != "url"},
        "summary": {name: summary(records) for name, records in curves.items()},
        "steps": curves,
    }
    stem = "torchrl_grpo-quick" if options.quick else "torchrl_grpo"
    (output / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    reward_plot(
        curves,
        output / f"{stem}.png",
        title="TorchRL GRPO on rlserve: SmolLM2-135M-Instruct, addition, 2-core CPU",
        xlabel="GRPO step (2 prompts x 8 replies)",
    )
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
