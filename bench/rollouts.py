"""Episodes per second: client-driven `collect` (a generate and a step round trip per turn)
against server-side `/v1/rollouts` (one request), at 8 and 32 parallel episodes.

    python bench/rollouts.py            # hidden 512, 6 layers; 2-turn episodes, 16 tokens a turn
    python bench/rollouts.py --quick    # small model smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from common import ROOT, bench_model, running_server, save_report
from rlserve_client import AsyncClient, collect


def env_config(parallel: int, max_turns: int) -> dict[str, Any]:
    return {
        "dataset": "arithmetic",
        "reward": "gsm8k",
        "batch_size": parallel,
        "max_turns": max_turns,
        "seed": 0,
    }


async def run_collect(
    api: AsyncClient, env: dict[str, Any], episodes: int, generation: dict[str, Any]
) -> tuple[int, int]:
    turns = episodes * env["max_turns"]
    done = [
        b
        async for b in collect(
            api, env=env, total_dialog_turns=turns, generation=generation, progress=False
        )
    ]
    return sum(len(b.trajectories) for b in done), sum(b.num_dialog_turns for b in done)


async def run_rollouts(
    api: AsyncClient, env: dict[str, Any], episodes: int, generation: dict[str, Any]
) -> tuple[int, int]:
    result = await api.rollouts(env=env, num_episodes=episodes, generation=generation)
    return len(result.trajectories), result.num_dialog_turns


async def measure(
    url: str, parallels: list[int], rounds: int, args: argparse.Namespace
) -> dict[str, Any]:
    generation = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "seed": 0}
    report: dict[str, Any] = {}
    async with AsyncClient(base_url=url, timeout=3600) as api:
        await run_rollouts(api, env_config(2, 1), 2, generation)  # warm-up
        for parallel in parallels:
            env = env_config(parallel, args.max_turns)
            episodes = parallel * rounds
            row: dict[str, Any] = {}
            for name, runner in (("collect", run_collect), ("rollouts", run_rollouts)):
                started = time.perf_counter()
                num_episodes, num_turns = await runner(api, env, episodes, generation)
                seconds = time.perf_counter() - started
                row[name] = {
                    "episodes": num_episodes,
                    "dialog_turns": num_turns,
                    "seconds": round(seconds, 3),
                    "episodes_per_s": round(num_episodes / seconds, 3),
                }
            row["rollouts_over_collect"] = round(
                row["rollouts"]["episodes_per_s"] / row["collect"]["episodes_per_s"], 3
            )
            report[str(parallel)] = row
            print(parallel, json.dumps(row))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="batches of episodes per point")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (512, 6)
    parallels = [2, 4] if args.quick else [8, 32]
    rounds = 1 if args.quick else args.rounds
    args.output.mkdir(parents=True, exist_ok=True)
    model = bench_model(args.output, hidden, layers)
    log = args.output / "rollouts-server.log"
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
        "RLSERVE_MODELS__DTYPE": "float32",
    }
    with running_server("--model", str(model), env=env, log=log) as server:
        results = asyncio.run(measure(server.url, parallels, rounds, args))
    report = {
        "model": {"hidden_size": hidden, "num_layers": layers},
        "episode": {"max_turns": args.max_turns, "max_new_tokens": args.max_new_tokens},
        "rounds": rounds,
        "parallel_episodes": results,
    }
    save_report(args, "rollouts", report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
