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
"""

from __future__ import annotations

import asyncio
import json
import platform
import statistics
import time
from typing import Any

import httpx
from common import bench_arguments, in_process

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


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    prefix = f'{name}{{model="policy"}} '
    line = next((line for line in text.splitlines() if line.startswith(prefix)), None)
    return float(line.split()[-1]) if line else 0.0


async def session(
    client: httpx.AsyncClient, index: int, args: Any, latencies: list[list[float]]
) -> int:
    """One episode; its prompt tokens, all turns together."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are an agent. Use the tool outputs to answer."},
        {"role": "user", "content": f"Task {index}: " + observation(index, 0, 40)},
    ]
    prompt_tokens = 0
    for turn in range(args.turns):
        body = {"messages": messages, "max_tokens": args.reply_tokens, "temperature": 0}
        started = time.perf_counter()
        response = await client.post("/v1/chat/completions", json=body)
        latencies[turn].append(time.perf_counter() - started)
        response.raise_for_status()
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
    args = parser.parse_args()
    from app.config import Settings

    model = "builtin:smollm2-135m-instruct"
    if args.quick:
        model, args.sessions, args.turns, args.observation_tokens = "builtin:tiny", 4, 3, 40
    base = Settings().replace(
        models={"model": model, "backend": "transformers", "load_reference": False},
        storage={"data_dir": args.output / ".data"},
    )
    results: dict[str, Any] = {
        "model": f"{model}, float32, transformers backend",
        "host": f"{platform.machine()}, {__import__('os').cpu_count()} cores, no GPU",
        "sessions": args.sessions,
        "turns": args.turns,
        "observation_tokens": args.observation_tokens,
        "reply_tokens": args.reply_tokens,
    }
    results["cache_bytes"] = int(args.cache_gib * (1 << 30))
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
    args.output.mkdir(parents=True, exist_ok=True)
    name = "agent_turns-quick.json" if args.quick else "agent_turns.json"
    (args.output / name).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
