"""Environment steps of another revision against this checkout, alternating: the service alone
(bench/null_server.py, models that cost nothing), 32 sessions of batch 1 under wrk, episodes
of a few lengths (text actions, no tools, a reset before each episode).

    .venv/bin/python bench/env_steps_ab.py --against 2f1f28f   # the code before issue 37
    .venv/bin/python bench/env_steps_ab.py --against HEAD~3 --rounds 5 --turns 16
    .venv/bin/python bench/env_steps_ab.py --against HEAD --quick

This VM's rates drift by 10-15 % from minute to minute, more than many changes are worth:
runs alternate between the two servers, round after round, so drift reaches both alike, and
the report gives every run. The other revision runs from a git worktree, with this checkout's
bench/null_server.py (older revisions have none; it needs only `tests.fake.backend.fake_app`),
on this checkout's virtual environment."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import overhead
import wrk_load
from common import ROOT, bench_arguments, free_port, running_process


def serve_and_step(root: Path, turns: int, seconds: float, data: Path) -> dict[str, Any]:
    """One env-step point against the null server of the checkout at `root`."""
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(data),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_ENVS__MAX_TURNS": str(overhead.ENV_TURNS),
        "PYTHONPATH": str(root),
    }
    port = free_port()
    command = [sys.executable, str(root / "bench" / "null_server.py"), "--port", str(port)]
    log = data.with_suffix(".log")
    with running_process(command, port, "/ready", env=env, log=log, timeout=600) as server:
        load = argparse.Namespace(load="wrk", seconds=seconds)
        return overhead.env_steps(load, server.url, 2000, server.process.pid, turns=turns)


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--against", required=True, help="the other git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, nargs="+", default=[16, 64])
    args = parser.parse_args()
    if not wrk_load.available():
        raise SystemExit("wrk is not installed (scripts/system-deps.sh installs it)")
    rounds, seconds = (1, 1.0) if args.quick else (args.rounds, 8.0)
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.against],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {revision: {}, "this checkout": {}}
    with tempfile.TemporaryDirectory(prefix="rlserve-ab-") as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(other), revision],
            check=True,
            capture_output=True,
        )
        try:
            (other / "bench" / "null_server.py").write_bytes(
                (ROOT / "bench" / "null_server.py").read_bytes()
            )
            roots = {revision: other, "this checkout": ROOT}
            for turns in args.turns:
                for round_ in range(rounds):
                    for side, (label, root) in enumerate(roots.items()):
                        data = Path(tmp) / f"data-{turns}-{round_}-{side}"
                        figures = serve_and_step(root, turns, seconds, data)
                        runs[label].setdefault(turns, []).append(figures)
                        print(
                            f"{turns} turns, {label}: {figures['per_s']} steps/s "
                            f"({figures['server_cpu_ms']} ms of server CPU a request)",
                            flush=True,
                        )
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)],
                check=False,
                capture_output=True,
            )
    report = summary(runs, revision, args.turns)
    print(json.dumps(report["ratios"], indent=2))
    name = "env_steps_ab-quick.json" if args.quick else "env_steps_ab.json"
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / name).write_text(json.dumps(report, indent=2) + "\n")


def summary(
    runs: dict[str, dict[int, list[dict[str, Any]]]], revision: str, turns: list[int]
) -> dict[str, Any]:
    """Every run, and per episode length the mean rate of each side and their ratio."""
    ratios = {}
    for length in turns:
        before = statistics.mean(r["per_s"] for r in runs[revision][length])
        after = statistics.mean(r["per_s"] for r in runs["this checkout"][length])
        ratios[f"{length} turns"] = {
            f"{revision} steps/s": round(before, 1),
            "this checkout steps/s": round(after, 1),
            "ratio": round(after / before, 2),
        }
    return {
        "work": "environment steps, text actions, no tools; 32 sessions of batch 1 under wrk; "
        "a reset before each episode (its time counted); the service alone (null server)",
        "against": revision,
        "ratios": ratios,
        "runs": {label: {str(k): v for k, v in by.items()} for label, by in runs.items()},
    }


if __name__ == "__main__":
    main()
