"""Weight upload over loopback: throughput, peak server RSS increase, and the pause it causes to
a concurrent stream of scoring requests.

    python bench/weights.py            # ~190 MB float32 state dict
    python bench/weights.py --quick    # small model smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, bench_model, running_server


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRSS(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.running = pid, 0, True

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(0.005)


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


async def measure(url: str, payload: Path, pid: int) -> dict[str, Any]:
    stop = asyncio.Event()
    stream = asyncio.create_task(scoring_stream(url, stop))
    # Warm up first: the model's weights are mapped lazily and the first forwards fault them
    # in, which must not be charged to the upload.
    await asyncio.sleep(1.0)
    baseline = rss_bytes(pid)
    sampler = PeakRSS(pid)
    sampler.start()
    start, end, result = await upload(url, payload)
    sampler.running = False
    sampler.join()
    await asyncio.sleep(1.0)
    stop.set()
    calls = await stream
    before = [e - s for s, e, v in calls if e < start]
    during = [(s, e) for s, e, v in calls if e >= start and s <= end + 0.5]
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(calls)]
    longest_wait = max((e - s for s, e in during), default=0.0)
    return {
        "upload_seconds": end - start,
        "server_swap_seconds": result["seconds"],
        "scoring_p50_ms_before": statistics.median(before) * 1000,
        "scoring_longest_ms_during_upload": longest_wait * 1000,
        "scoring_pause_ms": (longest_wait - statistics.median(before)) * 1000,
        "max_gap_between_calls_ms": max(gaps) * 1000 if gaps else 0.0,
        "versions_seen": sorted({v for _, _, v in calls}),
        "policy_version_after": result["policy_version"],
        "rss_baseline_bytes": baseline,
        "rss_peak_bytes": sampler.peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    hidden, layers = (64, 2) if args.quick else (1024, 3)
    args.output.mkdir(parents=True, exist_ok=True)
    dirs = [bench_model(args.output, hidden, layers, seed) for seed in (0, 1)]
    payload = dirs[1] / "model.safetensors"
    size = payload.stat().st_size
    env = {"RLSERVE_LOAD_REFERENCE": "false", "RLSERVE_DATA_DIR": str(args.output / ".data")}
    log = args.output / "weights-server.log"
    with running_server("--model", str(dirs[0]), env=env, log=log) as server:
        figures = asyncio.run(measure(server.url, payload, server.process.pid))
    baseline, peak = figures.pop("rss_baseline_bytes"), figures.pop("rss_peak_bytes")
    figures |= {
        "payload_mb": size / 1e6,
        "throughput_mb_per_s": size / 1e6 / figures["upload_seconds"],
        "rss_baseline_mb": baseline / 1e6,
        "rss_peak_increase_mb": (peak - baseline) / 1e6,
        "rss_increase_over_payload": (peak - baseline) / size,
    }
    figures["goals"] = {
        "throughput_at_least_200_mb_per_s": figures["throughput_mb_per_s"] >= 200,
        "rss_increase_below_1.2x_payload": figures["rss_increase_over_payload"] < 1.2,
        "pause_below_1_s": figures["scoring_pause_ms"] < 1000,
    }
    report = {"model": f"built-in Qwen2, hidden {hidden}, {layers} layers, float32, CPU", **figures}
    name = "weights-quick" if args.quick else "weights"
    (args.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
