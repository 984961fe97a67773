"""Weight updates over loopback, one server and one model, three ways: HTTP upload, path load,
and the collective transfer (gloo). Each runs on a quiet server (`--repeats` updates back to
back: the median is the steady state of a training loop, every run is listed) and then once
under a back-to-back stream of scoring requests (throughput, the pause the update causes to
that stream, peak server RSS increase).

    python bench/weights.py            # ~0.75 GB float32 state dict
    python bench/weights.py --quick    # small model smoke run
"""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from common import PeakRSS, bench_arguments, bench_model, rss_bytes, running_server, save_report


async def scoring_stream(url: str, stop: asyncio.Event) -> list[tuple[float, float, int]]:
    """(start, end, policy_version) of back-to-back /v1/logprobs calls until `stop`."""
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        body = {"tokens": [list(range(1, 65))]}
        while not stop.is_set():
            start = time.perf_counter()
            response = await client.post("/v1/logprobs", json=body)
            response.raise_for_status()
            out.append((start, time.perf_counter(), response.json()["policy_version"]))
    return out


async def upload(url: str, payload: Path) -> tuple[float, float, dict[str, Any]]:
    async def chunks() -> Any:
        with payload.open("rb") as f:
            while block := f.read(1 << 20):
                yield block

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        response = await client.put("/v1/weights", content=chunks())
        end = time.perf_counter()
    response.raise_for_status()
    return start, end, response.json()


async def load(url: str, payload: Path) -> tuple[float, float, dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        response = await client.post("/v1/weights/load", json={"path": str(payload)})
        end = time.perf_counter()
    response.raise_for_status()
    return start, end, response.json()


async def transfer(url: str, payload: Path) -> tuple[float, float, dict[str, Any]]:
    """The trainer's side: join (not timed, once per training run), then one send."""
    from rlserve_client import Client
    from safetensors.torch import load_file

    state = load_file(payload)

    def trainer() -> tuple[float, float, dict[str, Any]]:
        with Client(base_url=url) as client, client.weight_transfer() as sync:
            start = time.perf_counter()
            result = sync.send(state)
            return start, time.perf_counter(), result.model_dump()

    return await asyncio.to_thread(trainer)


async def measure(url: str, update: Any, payload: Path, repeats: int) -> dict[str, Any]:
    """`repeats` updates back to back; the median is the steady state a training loop sees."""
    runs = [await update(url, payload) for _ in range(repeats)]
    seconds = [end - start for start, end, _ in runs]
    median = statistics.median(seconds)
    return {
        "seconds": median,
        "gb_per_s": payload.stat().st_size / 1e9 / median,
        "seconds_each": seconds,
        "server_swap_seconds": statistics.median(r["seconds"] for _, _, r in runs),
        "policy_version_after": runs[-1][2]["policy_version"],
    }


async def measure_under_scoring(url: str, update: Any, payload: Path, pid: int) -> dict[str, Any]:
    stop = asyncio.Event()
    stream = asyncio.create_task(scoring_stream(url, stop))
    # Warm up first: the model's weights are mapped lazily and the first forwards fault them
    # in, which must not be charged to the upload.
    await asyncio.sleep(1.0)
    baseline = rss_bytes(pid)
    with PeakRSS(pid, every_s=0.005) as sampler:
        start, end, result = await update(url, payload)
    await asyncio.sleep(1.0)
    stop.set()
    calls = await stream
    before = [e - s for s, e, v in calls if e < start]
    during = [(s, e) for s, e, v in calls if e >= start and s <= end + 0.5]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(calls)]
    longest_wait = max((e - s for s, e in during), default=0.0)
    return {
        "seconds": end - start,
        "gb_per_s": payload.stat().st_size / 1e9 / (end - start),
        "server_swap_seconds": result["seconds"],
        "scoring_p50_ms_before": statistics.median(before) * 1000,
        "scoring_longest_ms_during_update": longest_wait * 1000,
        "scoring_pause_ms": (longest_wait - statistics.median(before)) * 1000,
        "max_gap_between_calls_ms": max(gaps) * 1000 if gaps else 0.0,
        "versions_seen": sorted({v for _, _, v in calls}),
        "policy_version_after": result["policy_version"],
        "rss_peak_increase_mb": (sampler.peak - baseline) / 1e6,
    }


def rounded(figures: dict[str, Any]) -> dict[str, Any]:
    def cut(value: Any) -> Any:
        if isinstance(value, list):
            return [cut(v) for v in value]
        return round(value, 4) if isinstance(value, float) else value

    return {k: cut(v) for k, v in figures.items()}


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=5, help="quiet updates per method")
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (2048, 3)
    args.output.mkdir(parents=True, exist_ok=True)
    dirs = [bench_model(args.output, hidden, layers, seed) for seed in (0, 1, 2)]
    payloads = {"http_upload": dirs[1], "path_load": dirs[2], "collective_transfer": dirs[1]}
    size = (dirs[1] / "model.safetensors").stat().st_size
    env = {
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_STORAGE__DATA_DIR": str(args.output / ".data"),
    }
    log = args.output / "weights-server.log"
    updates = {"http_upload": upload, "path_load": load, "collective_transfer": transfer}
    figures: dict[str, Any] = {"quiet": {}, "under_scoring": {}}
    with running_server("--model", str(dirs[0]), env=env, log=log) as server:
        pid = server.process.pid
        # The first update writes into weights still mapped from the model file, which costs
        # it a copy-on-write fault per page; trainers update every step, so measure after it.
        asyncio.run(load(server.url, dirs[0] / "model.safetensors"))
        for name, update in updates.items():
            payload = payloads[name] / "model.safetensors"
            quiet = asyncio.run(measure(server.url, update, payload, args.repeats))
            loaded = asyncio.run(measure_under_scoring(server.url, update, payload, pid))
            figures["quiet"][name] = rounded(quiet)
            figures["under_scoring"][name] = rounded(loaded)
    quiet, loaded = figures["quiet"], figures["under_scoring"]
    goals = {
        "collective_at_least_1_gb_per_s": quiet["collective_transfer"]["gb_per_s"] >= 1.0,
        "collective_at_least_4x_http_upload": quiet["collective_transfer"]["gb_per_s"]
        >= 4 * quiet["http_upload"]["gb_per_s"],
        "collective_at_least_4x_http_upload_under_scoring": loaded["collective_transfer"][
            "gb_per_s"
        ]
        >= 4 * loaded["http_upload"]["gb_per_s"],
        "collective_pause_within_transfer_plus_100_ms": loaded["collective_transfer"][
            "scoring_pause_ms"
        ]
        <= loaded["collective_transfer"]["seconds"] * 1000 + 100,
    }
    report = {
        "model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, CPU",
        "payload_gb": round(size / 1e9, 3),
        **figures,
        "goals": goals,
    }
    save_report(args, "weights", report)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
