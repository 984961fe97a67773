"""GRPO on SmolLM2-135M-Instruct, the bundled addition task: through rlserve vs in-process.

Both loops take the same steps with the same hyper-parameters, seeds and loss
(examples/grpo.py's `grpo_step`):
- rlserve: examples/grpo.py against a server (transformers backend): `/v1/rollouts` samples
  and rewards each step's groups, the trainer learns, the collective transfer pushes weights;
- local: no server; transformers `generate` samples the same number of prompts (drawn from the
  same bundled problems), the same reward function scores them, the same step learns.

Prints reward (= accuracy: the reward is 1 for a right answer, else 0) per step, steps/s and
wall time; writes learning.json and learning.png (reward per step, both loops). Then times a
few more steps of each loop at equal work (every reply runs max_new_tokens: the learning runs'
policies soon differ in reply length, and with it in cost per step).

    .venv/bin/python bench/learning.py                # 40 steps each (about 30 minutes here)
    .venv/bin/python bench/learning.py --quick        # 2 steps each, 2 groups a step
"""

from __future__ import annotations

import functools
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import bench_arguments, reward_plot, running_server, thirds
from rlserve_client import Client
from rlserve_client.advantages import group_advantages
from rlserve_client.types import Trajectory

from app.config import Settings
from app.config_groups import DEFAULT_MODEL
from app.datasets.bundled import sum_problems
from app.engine.loader import smollm2_dir
from app.envs.rewards import Sample, score_reward
from examples.grpo import Rollout, arguments, grpo_step, train


def local_rollouts(model: Any, tokenizer: Any, args: Any, step: int) -> list[Rollout]:
    """The server's episode without a server: prompts from the bundled problems, templated
    by the model's chat template, sampled by `generate` at temperature 1 (no top-k/top-p)."""
    rng = random.Random(args.seed * 100_003 + step)
    problems = rng.sample(sum_problems(), args.prompts)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.query}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
        for p in problems
    ]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    # left padding, by length: the pad token (<|im_end|>) also ends every templated turn
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(args.seed * 100_003 + step)
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens if args.fixed_length else None,
            num_return_sequences=args.group_size,
            pad_token_id=pad,
        )
    rollouts, rewards = [], []
    for i, row in enumerate(out[:, width:].tolist()):
        problem, prompt = problems[i // args.group_size], prompts[i // args.group_size]
        eos = tokenizer.eos_token_id
        response = row[: row.index(eos) + 1] if eos in row and not args.fixed_length else row
        text = tokenizer.decode(response)
        reward = score_reward("number", {}, Sample(text, problem.answer)).reward
        rollouts.append(Rollout(prompt, response, reward, 0.0))
        rewards.append([reward])
    for rollout, (advantage,) in zip(
        rollouts, group_advantages(rewards, args.group_size), strict=True
    ):
        rollout.advantage = advantage
    return rollouts


def train_local(args: Any) -> list[dict[str, float]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = smollm2_dir(Settings().models)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(source)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    records = []
    for step in range(args.steps):
        started = time.perf_counter()
        model.eval()
        rollouts = local_rollouts(model, tokenizer, args, step)
        sampled = time.perf_counter()
        stats = grpo_step(model, optimizer, rollouts, args.clip)
        record = {
            "step": step,
            "reward": statistics.fmean(r.reward for r in rollouts),
            **stats,
            "response_tokens": sum(len(r.response) for r in rollouts),
            "wait_s": sampled - started,
            "train_s": time.perf_counter() - sampled,
            "step_s": time.perf_counter() - started,
        }
        print("local", json.dumps(record), flush=True)
        records.append(record)
    return records


def train_rlserve(
    args: Any,
    output: Path,
    more_env: dict[str, str] | None = None,
    name: str = "learning",
    before_push: Callable[[Client, list[Trajectory]], None] | None = None,
) -> list[dict[str, float]]:
    """examples/grpo.py's loop against a server on SmolLM2 (`more_env`: more settings; its
    log is `output/NAME-server.log`; `before_push`: `train`'s, with the client)."""
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        **(more_env or {}),
    }
    log = output / f"{name}-server.log"
    records = []
    with running_server("--model", DEFAULT_MODEL, env=env, log=log, ready_timeout=600) as server:
        args.url = server.url
        with Client(base_url=server.url, timeout=600) as client:
            hook = None if before_push is None else functools.partial(before_push, client)
            for record in train(client, args, hook):
                print(name, json.dumps(record), flush=True)
                records.append(record)
    return records


def summary(records: list[dict[str, float]]) -> dict[str, float]:
    """Reward at the start and the end (the mean of each third of the steps, with the standard
    error of the step means: the run-to-run noise), and where the time went."""
    total = sum(r["step_s"] for r in records)
    return {
        "steps": len(records),
        **thirds([r["reward"] for r in records], "_reward"),
        "steps_per_s": len(records) / total,
        "wall_s": total,
        "wait_s": sum(r["wait_s"] for r in records),
        "response_tokens": sum(r["response_tokens"] for r in records),
        "max_behaviour_drift": max(r["behaviour_drift"] for r in records),
    }


def speed(records: list[dict[str, float]]) -> dict[str, float]:
    """Steps of equal work (fixed-length replies); the first one, a warm-up, is left out."""
    timed = records[1:] or records
    return {
        "steps": len(timed),
        "steps_per_s": len(timed) / sum(r["step_s"] for r in timed),
        "wait_s": statistics.fmean(r["wait_s"] for r in timed),
        "train_s": statistics.fmean(r["train_s"] for r in timed),
        "push_s": statistics.fmean(r.get("push_s", 0.0) for r in timed),
    }


def run(name: str, args: Any, output: Path) -> list[dict[str, float]]:
    return train_rlserve(args, output) if name == "rlserve" else train_local(args)


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--speed-steps", type=int, default=5, help="fixed-length steps, timed")
    parser.add_argument("--loops", default="rlserve,local")
    options = parser.parse_args()
    steps, speed_steps = (2, 2) if options.quick else (options.steps, options.speed_steps)
    names = options.loops.split(",")
    output: Path = options.output
    output.mkdir(parents=True, exist_ok=True)
    # --quick checks that the script runs (CI's smoke test): half the groups a step
    size = ["--prompts", "2"] if options.quick else []
    args = arguments(["--steps", str(steps), *size])
    loops = {name: run(name, args, output) for name in names}
    timing = arguments(["--steps", str(speed_steps), "--fixed-length", *size])
    timed = {name: speed(run(name, timing, output)) for name in names}
    report = {
        "hyper_parameters": {k: v for k, v in vars(args).items() if k not in ("url", "log")},
        "summary": {name: summary(records) for name, records in loops.items()},
        "equal_work": timed,
        "steps": loops,
    }
    if "rlserve" in timed and "local" in timed:
        ratio = timed["rlserve"]["steps_per_s"] / timed["local"]["steps_per_s"]
        report["equal_work_rlserve_over_local"] = ratio
    stem = "learning-quick" if options.quick else "learning"
    (output / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    reward_plot(
        loops,
        output / f"{stem}.png",
        title="SmolLM2-135M-Instruct, addition task, 2-core CPU",
        xlabel="GRPO step",
        window=5,
    )
    print(json.dumps({k: report[k] for k in report if k != "steps"}, indent=2))


if __name__ == "__main__":
    main()
