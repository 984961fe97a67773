"""Mixed traffic from many clients for a while, every outcome counted: environment sessions
(create, reset, step, get, delete), generations and scores, each client pausing now and then
for about as long as an HTTP client keeps an idle connection (httpx: 5 s), which is when a
server that closes idle connections at the same moment drops a request without an answer.

    python bench/load.py                  # 64 clients, 60 s, the built-in tiny model
    python bench/load.py --quick          # 8 clients, 12 s (the CI smoke run)
    python bench/load.py --url URL        # against a running server

Prints one row per route and outcome (a status code, or the transport error a client saw)
and exits 1 when any request ended in a 5xx or without an answer."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx
from common import bench_arguments, running_server


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[tuple[str, str]] = Counter()

    async def call(
        self, client: httpx.AsyncClient, method: str, route: str, path: str, **kw: Any
    ) -> httpx.Response | None:
        try:
            response = await client.request(method, path, **kw)
        except httpx.HTTPError as error:  # no answer: the failure this benchmark hunts
            self.outcomes[route, type(error).__name__] += 1
            return None
        self.outcomes[route, str(response.status_code)] += 1
        return response

    def failures(self) -> int:
        return sum(
            n
            for (_, outcome), n in self.outcomes.items()
            if not outcome.isdigit() or outcome[0] == "5"
        )


async def episode(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    """One environment session from creation to deletion, a few steps long."""
    created = await tally.call(
        client, "POST", "env_create", "/v1/envs", json={"batch_size": 2, "max_turns": 4}
    )
    if created is None or created.status_code != 201:
        return
    env = created.json()["env_id"]
    await tally.call(
        client, "POST", "env_reset", f"/v1/envs/{env}/reset", json={"query": ["2 + 2?", "hi"]}
    )
    for turn in range(rng.randint(1, 3)):
        actions = [{"text": f"answer {turn}"}, {"text": "4"}]
        stepped = await tally.call(
            client,
            "POST",
            "env_step",
            f"/v1/envs/{env}/step",
            json={"actions": actions},
            headers={"Idempotency-Key": f"{env}-{turn}"},
        )
        if stepped is None or stepped.status_code != 200:
            break
        if any(o["done"] for o in stepped.json()["outputs"]):
            break
    await tally.call(client, "GET", "env_get", f"/v1/envs/{env}")
    await tally.call(client, "DELETE", "env_delete", f"/v1/envs/{env}")


async def model_call(client: httpx.AsyncClient, tally: Tally, rng: random.Random) -> None:
    tokens = [rng.randrange(3, 250) for _ in range(rng.randint(4, 32))]
    if rng.random() < 0.5:
        body = {"tokens": [tokens], "max_tokens": 4, "seed": rng.randrange(1 << 30)}
        await tally.call(client, "POST", "generate", "/v1/generate", json=body)
    else:
        await tally.call(client, "POST", "logprobs", "/v1/logprobs", json={"tokens": [tokens]})


async def client_loop(url: str, deadline: float, tally: Tally, seed: int, idle_s: float) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            if rng.random() < 0.5:
                await episode(client, tally, rng)
            else:
                await model_call(client, tally, rng)
            if rng.random() < 0.1:  # idle for about as long as the client keeps a connection
                await asyncio.sleep(idle_s + rng.uniform(-0.2, 0.05))


async def run(url: str, clients: int, seconds: float, idle_s: float) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client_loop(url, deadline, tally, i, idle_s) for i in range(clients)))
    return tally


def report(tally: Tally, clients: int, seconds: float) -> dict[str, Any]:
    total = sum(tally.outcomes.values())
    print(f"{clients} clients x {seconds:g} s: {total} requests, {tally.failures()} failed")
    print(f"{'route':<12} {'outcome':<22} {'count':>7}")
    for (route, outcome), n in sorted(tally.outcomes.items()):
        print(f"{route:<12} {outcome:<22} {n:>7}")
    return {
        "clients": clients,
        "seconds": seconds,
        "requests": total,
        "failed": tally.failures(),
        "outcomes": {f"{r} {o}": n for (r, o), n in sorted(tally.outcomes.items())},
    }


def main() -> int:
    parser = bench_arguments(__doc__)
    parser.add_argument("--url", help="a running server (default: start one on builtin:tiny)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument(
        "--idle-s", type=float, default=5.0, help="the pause: httpx's keep-alive expiry"
    )
    args = parser.parse_args()
    clients, seconds = (8, 12.0) if args.quick else (args.clients, args.seconds)
    if args.url:
        tally = asyncio.run(run(args.url, clients, seconds, args.idle_s))
    else:
        args.output.mkdir(parents=True, exist_ok=True)
        env = {
            "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data-load"),
        }
        with running_server(env=env, log=args.output / "load-server.log") as server:
            tally = asyncio.run(run(server.url, clients, seconds, args.idle_s))
    figures = report(tally, clients, seconds)
    args.output.mkdir(parents=True, exist_ok=True)
    name = "load-quick.json" if args.quick else "load.json"
    (args.output / name).write_text(json.dumps(figures, indent=2) + "\n")
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
