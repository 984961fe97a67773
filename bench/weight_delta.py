"""Weight pushes as deltas of the last push (`rlserve_client.weight_push.WeightPusher`)
against whole pushes: SmolLM2-135M-Instruct after real GRPO steps (examples/grpo.py's loop,
AdamW and learning rate, sampling from the server), served in float32 and in bfloat16, on one
server and on two Ray Serve replicas (sessions in a redis-server), transformers backend, this
CPU.

    python bench/weight_delta.py          # 6 GRPO steps: 5 deltas per deployment
    python bench/weight_delta.py --quick  # 3 steps, one server (no replicas)

The training run pushes its steps to a float32 server as it trains (the first push whole, then
deltas); every state it pushed is kept and pushed again, in order, to each other deployment.
Per delta: the share of elements that changed (in the served dtype), the bytes a whole push
sends and the bytes the delta sent, the seconds to encode it (trainer), the request's round
trip, the server's staging (receive, rebuild and check: `total_seconds - seconds`) and its
commit (serving paused: `seconds`), and whether the served digest is the trainer's. The limit
for the apply is this host's memory-copy bandwidth, measured in the same run. The same states
go over the collective transfer too (`weight_transfer(deltas=True)`, gloo on this host), the
first send whole and the later ones deltas, on each one-server deployment."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    bench_arguments,
    copy_bandwidth,
    free_port,
    ray_serve_env,
    running_process,
    running_server,
    save_report,
    wait_for_replicas,
)

from tests.stores.redis_server import running_redis

GOAL_RATIO = 3.0
GOAL_APPLY_SHARE = 0.5


def changed_share(before: dict[str, Any], after: dict[str, Any], dtype: Any) -> float:
    """The share of elements whose value in `dtype` differs between two states."""
    changed = total = 0
    for name, tensor in after.items():
        new, old = tensor.to(dtype), before[name].to(dtype)
        changed += int((new != old).sum())
        total += new.numel()
    return changed / total


def figures(pushed: Any, share: float, replicated: bool = False) -> dict[str, Any]:
    """One push's figures. On replicas the answer is the commit's (each replica staged the
    update before it): the round trip is the whole update there."""
    updated = pushed.updated
    staged = None if replicated else round(updated.total_seconds - updated.seconds, 3)
    server_s = max(updated.total_seconds, 1e-9)
    return {
        "version": updated.policy_version,
        "delta": pushed.delta,
        "changed_elements": round(share, 5),
        "full_bytes": pushed.full_bytes,
        "sent_bytes": pushed.sent_bytes,
        "full_over_sent": round(pushed.full_bytes / pushed.sent_bytes, 2),
        "encode_s": round(pushed.encode_s, 3),
        "round_trip_s": round(pushed.send_s, 3),
        "server_stage_s": staged,
        "server_commit_s": round(updated.seconds, 3),
        "rebuilt_bytes": updated.num_bytes,
        "server_gb_per_s": None if replicated else round(updated.num_bytes / server_s / 1e9, 3),
        "digest_ok": pushed.digest_ok,
    }


def summary(steps: list[dict[str, Any]]) -> dict[str, Any]:
    deltas = [s for s in steps if s["delta"]]
    if not deltas:  # (every push whole: the deltas were over `delta_max_share`)
        return {
            "deltas": 0,
            "median_whole_round_trip_s": statistics.median(s["round_trip_s"] for s in steps),
            "digests_ok": all(s["digest_ok"] for s in steps),
        }
    return {
        "deltas": len(deltas),
        "median_full_over_sent": statistics.median(s["full_over_sent"] for s in deltas),
        "median_changed_elements": statistics.median(s["changed_elements"] for s in deltas),
        "median_round_trip_s": statistics.median(s["round_trip_s"] for s in deltas),
        "whole_push_round_trip_s": next(s["round_trip_s"] for s in steps if not s["delta"]),
        "median_server_stage_s": _median([s["server_stage_s"] for s in deltas]),
        "median_server_commit_s": statistics.median(s["server_commit_s"] for s in deltas),
        "digests_ok": all(s["digest_ok"] for s in steps),
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def train_and_record(url: str, steps: int, log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """examples/grpo.py's loop for `steps` steps, its pushes by `WeightPusher` (float32): the
    state pushed at each step, kept on the host."""
    import torch
    from rlserve_client import Client
    from rlserve_client.weight_push import WeightPusher

    sys.path.insert(0, str(ROOT / "examples"))
    import grpo

    states: list[dict[str, Any]] = []

    class Recorded:
        """examples/grpo.py's FullWeights, by HTTP deltas, each state kept."""

        def __init__(self, client: Client, transport: str = "auto") -> None:
            self.pusher = WeightPusher(client, dtype=torch.float32)
            self.model = "policy"

        def push(self, model: torch.nn.Module) -> int:
            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            share = changed_share(states[-1], state, torch.float32) if states else 1.0
            states.append(state)
            pushed = self.pusher.push(state)
            log.append(figures(pushed, share))
            print("float32, one server:", log[-1], flush=True)
            return pushed.updated.policy_version

        def close(self) -> None:
            pass

    grpo.FullWeights = Recorded  # the example's push, by deltas
    argv = ["--steps", str(steps), "--prompts", "2", "--group-size", "4"]
    args = grpo.arguments([*argv, "--max-new-tokens", "16"])
    with Client(base_url=url, timeout=600) as client:
        for record in grpo.train(client, args):
            print(f"GRPO step {record['step']}: reward {record['reward']}", flush=True)
    return states


def replay(
    url: str, states: list[dict[str, Any]], dtype_name: str, label: str, replicated: bool = False
) -> list[Any]:
    import torch
    from rlserve_client import Client
    from rlserve_client.weight_push import WeightPusher

    dtype = getattr(torch, dtype_name)
    out = []
    with Client(base_url=url, timeout=600, max_retries=0) as client:
        pusher = WeightPusher(client, dtype=dtype)
        for i, state in enumerate(states):
            share = changed_share(states[i - 1], state, dtype) if i else 1.0
            out.append(figures(pusher.push(state), share, replicated))
            print(f"{label}:", out[-1], flush=True)
    return out


def replay_transfer(
    url: str, states: list[dict[str, Any]], dtype_name: str, label: str
) -> list[dict[str, Any]]:
    """The same states over the collective transfer (gloo, this host's loopback), with
    `weight_transfer(deltas=True)`: the first send whole, each later one a delta broadcast as
    one uint8 tensor. Per send the same figures as an HTTP push's (encode and send together
    in the round trip)."""
    import torch
    from rlserve_client import Client
    from rlserve_client.weight_delta import weights_digest
    from rlserve_client.weight_push import host_copies

    dtype = getattr(torch, dtype_name)
    out = []
    with (
        Client(base_url=url, timeout=600, max_retries=0) as client,
        client.weight_transfer(master_address="127.0.0.1", deltas=True) as sync,
    ):
        for i, state in enumerate(states):
            share = changed_share(states[i - 1], state, dtype) if i else 1.0
            every, cast = host_copies(state, dtype)
            full = sum(t.numel() * t.element_size() for t in cast.values())
            started = time.perf_counter()
            updated = sync.send(state)
            round_trip = time.perf_counter() - started
            sent = updated.sent_bytes if updated.sent_bytes is not None else full
            out.append(
                {
                    "version": updated.policy_version,
                    "delta": updated.sent_bytes is not None,
                    "changed_elements": round(share, 5),
                    "full_bytes": full,
                    "sent_bytes": sent,
                    "full_over_sent": round(full / sent, 2),
                    "round_trip_s": round(round_trip, 3),
                    "server_stage_s": round(updated.total_seconds - updated.seconds, 3),
                    "server_commit_s": round(updated.seconds, 3),
                    "digest_ok": updated.digest == weights_digest(every),
                }
            )
            print(f"{label}:", out[-1], flush=True)
    return out


def apply_in_process(states: list[dict[str, Any]], dtype_name: str, tmp: Path) -> list[Any]:
    """The server's apply alone, on this host's cores (no HTTP, no disk write): each delta
    rebuilt from served tensors and checked (`app.weights.delta.stage`), then copied in (the
    commit's `write_tensors`); bytes rebuilt a second."""
    import torch
    from rlserve_client.weight_delta import DeltaEncoder

    from app.common.roles import Role
    from app.weights.checkpoint import layout_of_state
    from app.weights.delta import read_delta, stage, write_changes

    dtype = getattr(torch, dtype_name)
    served = {k: v.to(dtype).clone() for k, v in states[0].items()}
    layout = layout_of_state(served)
    encoder = DeltaEncoder()
    encoder.remember(served, 0, None)
    out = []
    for version, state in enumerate(states[1:], start=1):
        cast = {k: v.to(dtype) for k, v in state.items()}
        blob = encoder.encode(cast).blob
        path = tmp / f"apply-{dtype_name}-{version}.delta"
        path.write_bytes(blob)
        started = time.perf_counter()
        staged = stage(read_delta(path, Role.UPLOAD), layout, served.__getitem__, version - 1)
        rebuilt = time.perf_counter()
        write_changes(served, staged.changes)
        committed = time.perf_counter()
        path.unlink()
        encoder.remember(cast, version, None)
        out.append(
            {
                "rebuilt_bytes": staged.num_bytes,
                "stage_s": round(rebuilt - started, 4),
                "commit_s": round(committed - rebuilt, 4),
                "apply_gb_per_s": round(staged.num_bytes / (committed - started) / 1e9, 3),
            }
        )
        print(f"apply in process, {dtype_name}:", out[-1], flush=True)
    return out


def main() -> None:
    parser = bench_arguments(__doc__)
    args = parser.parse_args()
    steps = 3 if args.quick else 6
    args.output.mkdir(parents=True, exist_ok=True)
    bandwidth = copy_bandwidth()
    print(f"memory copy: {bandwidth / 1e9:.2f} GB/s", flush=True)
    env = ray_serve_env(args.output)
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    # (--quick: the tiny built-in model; else the default, SmolLM2-135M-Instruct)
    env["RLSERVE_MODELS__MODEL"] = "builtin:tiny" if args.quick else "builtin:smollm2-135m-instruct"
    f32_env = {**env, "RLSERVE_MODELS__DTYPE": "float32"}
    with running_server(env=f32_env, log=args.output / "delta-f32.log", ready_timeout=900) as s:
        results["one_server_float32"] = []
        states = train_and_record(s.url, steps, results["one_server_float32"])
        label = "float32, one server, collective transfer"
        results["transfer_float32"] = replay_transfer(s.url, states, "float32", label)
    applied = {
        dtype_name: apply_in_process(states, dtype_name, args.output)
        for dtype_name in ("float32", "bfloat16")
    }
    bf16_env = {**env, "RLSERVE_MODELS__DTYPE": "bfloat16"}
    with running_server(env=bf16_env, log=args.output / "delta-bf16.log", ready_timeout=900) as s:
        results["one_server_bfloat16"] = replay(s.url, states, "bfloat16", "bfloat16, one server")
        label = "bfloat16, one server, collective transfer"
        results["transfer_bfloat16"] = replay_transfer(s.url, states, "bfloat16", label)
    # (--quick: one server only; the replicas' path has its own tests, tests/deploy, and two
    # Ray Serve replicas beside a busy test suite were the smoke's one flaky part)
    replica_dtypes = () if args.quick else ("float32", "bfloat16")
    with running_redis(args.output / ".data") as redis_url:
        for dtype_name in replica_dtypes:
            port = free_port()
            command = [sys.executable, "-m", "app.cli", "serve", "--replicas", "2"]
            command += ["--port", str(port)]
            replicas_env = {
                **env,
                "RLSERVE_STORAGE__SESSION_STORE": redis_url,
                "RLSERVE_MODELS__DTYPE": dtype_name,
            }
            log = args.output / f"delta-replicas-{dtype_name}.log"
            with running_process(
                command, port, "/ready", env=replicas_env, log=log, timeout=900
            ) as served:
                wait_for_replicas(served.url, 2, timeout=900)
                label = f"{dtype_name}, two Ray Serve replicas"
                key = f"two_replicas_{dtype_name}"
                results[key] = replay(served.url, states, dtype_name, label, replicated=True)
    summaries = {name: summary(runs) for name, runs in results.items()}
    for dtype_name, runs in applied.items():
        speed = statistics.median(r["apply_gb_per_s"] for r in runs) * 1e9
        summaries[f"apply_in_process_{dtype_name}"] = {
            "median_apply_gb_per_s": round(speed / 1e9, 3),
            "apply_share_of_copy_bandwidth": round(speed / bandwidth, 3),
            "median_commit_s": statistics.median(r["commit_s"] for r in runs),
        }
    bf16 = summaries["one_server_bfloat16"]
    bf16_apply = summaries["apply_in_process_bfloat16"]
    report = {
        "model": "SmolLM2-135M-Instruct (the default model), transformers backend, CPU",
        "host": "2 CPU cores, no GPU; the replicas share them with Ray's own processes",
        "training": f"examples/grpo.py: {steps} steps, 2 groups of 4, 16 new tokens, AdamW "
        "lr 3e-5, float32 trainer",
        "memory_copy_gb_per_s": round(bandwidth / 1e9, 3),
        "summaries": summaries,
        "goals": {
            f"bfloat16_at_least_{GOAL_RATIO:g}x_fewer_bytes": bf16["median_full_over_sent"]
            >= GOAL_RATIO,
            "bfloat16_apply_at_half_the_copy_bandwidth": bf16_apply["apply_share_of_copy_bandwidth"]
            >= GOAL_APPLY_SHARE,
        },
        "results": results,
        "apply_in_process": applied,
        "seconds": round(time.perf_counter() - started, 1),
    }
    save_report(args, "weight_delta", report)
    print(json.dumps({k: v for k, v in report.items() if k != "results"}, indent=2))


if __name__ == "__main__":
    main()
