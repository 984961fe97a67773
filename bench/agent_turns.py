"""Agent sessions with and without the prefix cache (`models.prefix_cache_bytes`).

Concurrent sessions of a multi-turn episode on SmolLM2-135M-Instruct through
/v1/chat/completions, as an agent harness drives it: each turn sends the whole history, the
reply is appended as the OpenAI SDK gives it back, then an observation (a tool's output, as a
user message of about `--observation-tokens` tokens), so the history grows to about
`turns x (observation + reply)` tokens. The same sessions run on a server with the cache and
on one without it (the server's reply is greedy: both see the same histories). Reported:
prompt tokens prefilled (with the cache: looked up minus found, from /metrics), the latency
of each turn (median over the sessions), and the memory the cache holds at the end.

    .venv/bin/python bench/agent_turns.py            # 16 sessions x 8 turns, ~2,000 tokens
    .venv/bin/python bench/agent_turns.py --quick    # builtin:tiny, 4 x 3: a smoke run
    .venv/bin/python bench/agent_turns.py --replicas --skip-one-server  # two replicas only

With `--replicas`, the same sessions also run on two Ray Serve replicas, each with its own
prefix cache: routed without affinity, with session affinity (`--sticky-sessions`), and with
affinity gated by load (`--affinity-threshold`); reported per routing: prompt tokens found in
the replicas' caches over those looked up (the hit rate), the turns each replica served, the
sessions each replica owns on the ring (each deployment's replicas have new ids, so a new
ring), the turns served off the session's owner, how often a session changed replica, and
the latencies.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import statistics
import sys
import time
from itertools import pairwise
from typing import Any

import httpx
from common import (
    bench_arguments,
    free_port,
    in_process,
    ray_serve_env,
    running_process,
    wait_for_replicas,
)

from tests.stores.redis_server import running_redis

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


def observation(session: int, turn: int, tokens: int) -> str:
    """A tool's output of about `tokens` tokens, different per session and turn."""
    words = [WORDS[(session * 7 + turn * 3 + i) % len(WORDS)] for i in range(tokens)]
    return f"Tool output (step {turn}): " + " ".join(words)


def metric_in(text: str, name: str) -> float:
    """A policy metric's value in a /metrics page (0 when absent)."""
    pattern = re.compile(rf'^{name}{{[^}}]*model="policy"[^}}]*}} (\S+)$', re.M)
    return sum(float(value) for value in pattern.findall(text))


async def metric(client: httpx.AsyncClient, name: str) -> float:
    return metric_in((await client.get("/metrics")).text, name)


async def session(
    client: httpx.AsyncClient,
    index: int,
    args: Any,
    latencies: list[list[float]],
    served_by: list[str] | None = None,
) -> int:
    """One episode; its prompt tokens, all turns together. On replicas its requests carry
    its id in `x-session-id` (the sticky router's key) and `served_by` collects the replica
    of each turn."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. Use the tool outputs to answer."},
        {"role": "user", "content": f"Task {index}: " + observation(index, 0, 40)},
    ]
    prompt_tokens = 0
    for turn in range(args.turns):
        body = {"messages": messages, "max_tokens": args.reply_tokens, "temperature": 0}
        started = time.perf_counter()
        headers = {"x-session-id": f"session-{index}"}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        latencies[turn].append(time.perf_counter() - started)
        response.raise_for_status()
        if served_by is not None:
            served_by.append(response.headers["x-rlserve-replica"])
        reply = response.json()
        prompt_tokens += reply["usage"]["prompt_tokens"]
        messages.append(reply["choices"][0]["message"])
        messages.append(
            {"role": "user", "content": observation(index, turn + 1, args.observation_tokens)}
        )
    return prompt_tokens


async def run(settings: Any, args: Any) -> dict[str, Any]:
    async with in_process(settings) as client:
        # one warm-up request, outside the figures
        warm = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        (await client.post("/v1/chat/completions", json=warm)).raise_for_status()
        queried0 = await metric(client, "rlserve_prefix_cache_queries_total")
        found0 = await metric(client, "rlserve_prefix_cache_hits_total")
        latencies: list[list[float]] = [[] for _ in range(args.turns)]
        started = time.perf_counter()
        prompts = await asyncio.gather(
            *(session(client, i, args, latencies) for i in range(args.sessions))
        )
        seconds = time.perf_counter() - started
        queried = await metric(client, "rlserve_prefix_cache_queries_total") - queried0
        found = await metric(client, "rlserve_prefix_cache_hits_total") - found0
        held = await metric(client, "rlserve_prefix_cache_bytes")
    prompt_tokens = sum(prompts)
    return {
        "seconds": round(seconds, 2),
        "prompt_tokens": prompt_tokens,
        "prefilled_tokens": int(prompt_tokens - found),
        "cache_queried_tokens": int(queried),
        "cache_hit_tokens": int(found),
        "cache_bytes_at_end": int(held),
        "turn_latency_median_s": [round(statistics.median(t), 3) for t in latencies],
    }


async def replica_metrics(client: httpx.AsyncClient, names: tuple[str, ...]) -> dict[str, dict]:
    """Each replica's values of `names` (GET /metrics until both replicas answered)."""
    seen: dict[str, dict[str, float]] = {}
    for _ in range(100):
        response = await client.get("/metrics")
        text = response.text
        seen[response.headers["x-rlserve-replica"]] = {n: metric_in(text, n) for n in names}
        if len(seen) == 2:
            return seen
    raise RuntimeError(f"only {sorted(seen)} of two replicas answered /metrics")


async def run_replicas(url: str, args: Any) -> dict[str, Any]:
    """The sessions against two replicas behind Ray Serve's proxy: prompt tokens found in
    the replicas' prefix caches over those looked up, and how often a session changed
    replica between turns."""
    names = ("rlserve_prefix_cache_queries_total", "rlserve_prefix_cache_hits_total")
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        before = await replica_metrics(client, names)
        latencies: list[list[float]] = [[] for _ in range(args.turns)]
        routes: list[list[str]] = [[] for _ in range(args.sessions)]
        started = time.perf_counter()
        await asyncio.gather(
            *(session(client, i, args, latencies, routes[i]) for i in range(args.sessions))
        )
        seconds = time.perf_counter() - started
        after = await replica_metrics(client, names)
        # Each session's owner on the ring: where its id goes with every replica idle.
        owners = [
            (await client.get("/ready", headers={"x-session-id": f"session-{i}"})).headers[
                "x-rlserve-replica"
            ]
            for i in range(args.sessions)
        ]
    queried, found = (sum(after[r][n] - before[r][n] for r in after) for n in names)
    turns = [replica for route in routes for replica in route]
    return {
        "seconds": round(seconds, 2),
        "cache_hit_rate": round(found / max(queried, 1), 3),
        "cache_queried_tokens": int(queried),
        "cache_hit_tokens": int(found),
        "turns_per_replica": sorted(turns.count(r) for r in set(turns)),
        "sessions_per_owner": sorted(owners.count(r) for r in set(owners)),
        "turns_off_owner": sum(r != owners[i] for i, route in enumerate(routes) for r in route),
        "replica_changes": sum(a != b for route in routes for a, b in pairwise(route)),
        "turn_latency_median_s": [round(statistics.median(t), 3) for t in latencies],
    }


def replicated(args: Any, model: str) -> dict[str, Any]:
    """Two Ray Serve replicas (sessions in a redis-server), each with the prefix cache:
    routed by the power-of-two default (no affinity), by session affinity alone, and by
    session affinity gated at `--affinity-threshold` requests in flight."""
    env = {
        **ray_serve_env(args.output),
        "RLSERVE_MODELS__MODEL": model,
        "RLSERVE_MODELS__PREFIX_CACHE_BYTES": str(int(args.cache_gib * (1 << 30))),
    }
    routings = {
        "no_affinity": [],
        "affinity": ["--sticky-sessions", "--affinity-threshold", str(10**6)],
        "load_gated_affinity": [
            *["--sticky-sessions", "--affinity-threshold", str(args.affinity_threshold)]
        ],
    }
    out: dict[str, Any] = {"affinity_threshold": args.affinity_threshold}
    with running_redis(args.output / ".data") as redis_url:
        for name, flags in routings.items():
            port = free_port()
            command = [sys.executable, "-m", "app.cli", "serve", "--replicas", "2", *flags]
            command += ["--port", str(port)]
            log = args.output / f"agent-turns-{name}.log"
            with running_process(
                command,
                port,
                "/ready",
                env={**env, "RLSERVE_STORAGE__SESSION_STORE": redis_url},
                log=log,
                timeout=900,
            ) as served:
                wait_for_replicas(served.url, 2, timeout=900)
                out[name] = asyncio.run(run_replicas(served.url, args))
            print(f"two replicas, {name}:", json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--observation-tokens", type=int, default=140)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=2.0,
        help="the prefix cache's memory (the sessions' histories take about 1.6 GB by the "
        "last turn in float32; below that, least recently used entries are evicted)",
    )
    parser.add_argument(
        "--replicas",
        action="store_true",
        help="also on two Ray Serve replicas: no affinity, affinity, load-gated affinity",
    )
    parser.add_argument(
        "--affinity-threshold",
        type=int,
        default=6,
        help="with --replicas: requests in flight on a session's replica past which it goes "
        "to the other",
    )
    parser.add_argument(
        "--skip-one-server", action="store_true", help="with --replicas: only the replicas' part"
    )
    args = parser.parse_args()
    from app.config import Settings

    model = "builtin:smollm2-135m-instruct"
    if args.quick:
        model, args.sessions, args.turns, args.observation_tokens = "builtin:tiny", 4, 3, 40
    base = Settings().replace(
        models={"model": model, "backend": "transformers", "load_reference": False},
        storage={"data_dir": args.output / ".data"},
    )
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / ("agent_turns-quick.json" if args.quick else "agent_turns.json")
    results: dict[str, Any] = {
        "model": f"{model}, float32, transformers backend",
        "host": f"{platform.machine()}, {os.cpu_count()} cores, no GPU",
        "sessions": args.sessions,
        "turns": args.turns,
        "observation_tokens": args.observation_tokens,
        "reply_tokens": args.reply_tokens,
        "cache_bytes": int(args.cache_gib * (1 << 30)),
    }
    if args.skip_one_server:  # keep the one-server figures of the last run
        results = {**json.loads(path.read_text()), **results}
    else:
        for name, cache_bytes in (("without_cache", 0), ("with_cache", results["cache_bytes"])):
            settings = base.replace(models={"prefix_cache_bytes": cache_bytes})
            results[name] = asyncio.run(run(settings, args))
            print(name, json.dumps(results[name]), flush=True)
        off, on = results["without_cache"], results["with_cache"]
        results["prefill_tokens_ratio"] = round(off["prefilled_tokens"] / on["prefilled_tokens"], 2)
        last = args.turns - 1
        results["last_turn_latency_ratio"] = round(
            off["turn_latency_median_s"][last] / on["turn_latency_median_s"][last], 2
        )
        results["seconds_ratio"] = round(off["seconds"] / on["seconds"], 2)
        print(json.dumps({k: results[k] for k in results if k.endswith("ratio")}))
    if args.replicas:
        results["two_replicas"] = replicated(args, model)
    path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
