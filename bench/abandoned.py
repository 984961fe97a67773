"""What abandoned work costs the requests after it, in-process on the built-in model:

- memory: process RSS after three max-size scoring calls (64 x 1,024 tokens), with the
  transformers backend's memory release after large calls, and with it off;
- latency: a 3-token generation on its own, and right after a n=256 x 4,000-token generation
  was cancelled one second into it (its rows stop at the next token).

    python bench/abandoned.py               # release after large calls on (the default)
    python bench/abandoned.py --no-release  # the same without it, for comparison
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from common import ROOT  # noqa: F401 - puts the project on sys.path

from app.common.service import Resolved
from app.config import Settings
from app.engine.registry import ModelRegistry
from app.engine.transformers import memory
from app.engine.types import SamplingConfig
from app.generation.service import GenerationService


def rss_mb() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 >> 20


async def scoring_memory(registry: ModelRegistry, release: bool) -> tuple[int, int]:
    memory.LARGE_CALL_TOKENS = 16_384 if release else 1 << 62
    backend = registry.get("policy").backend
    sequences = [[5 + (i + j) % 50 for j in range(1024)] for i in range(64)]
    await backend.score(sequences[:2])
    before = rss_mb()
    for _ in range(3):
        await backend.score(sequences)
    return before, rss_mb()


async def latency_after_abandon(registry: ModelRegistry, settings: Settings) -> tuple[float, float]:
    service = GenerationService(registry, settings.limits)
    prompts = registry.get("policy").preparer.prompts(None, None, [[5, 6, 7]], "tokens")
    small = Resolved(SamplingConfig(max_new_tokens=3))
    started = time.perf_counter()
    await service.sample("policy", prompts, small, seed=0)
    alone = time.perf_counter() - started
    huge = Resolved(SamplingConfig(max_new_tokens=4000, ignore_eos=True))
    big = asyncio.create_task(service.sample("policy", prompts, huge, n=256, seed=1))
    await asyncio.sleep(1.0)
    big.cancel()
    started = time.perf_counter()
    await service.sample("policy", prompts, small, seed=2)
    return alone, time.perf_counter() - started


async def main(release: bool) -> None:
    settings = Settings(models={"model": "builtin:tiny", "load_reference": False})
    registry = ModelRegistry(
        settings.models,
        settings.vllm,
        batching=settings.batching.config(),
        state_dir=settings.storage.data_dir / "vllm-weights",
    )
    await registry.load()
    before, after = await scoring_memory(registry, release)
    state = "on" if release else "off"
    print(f"memory release {state}: RSS {before} MB -> {after} MB after 3 max-size scoring calls")
    alone, after_abandon = await latency_after_abandon(registry, settings)
    print(
        f"3-token generation: {alone * 1000:.0f} ms alone, {after_abandon * 1000:.0f} ms right "
        "after cancelling n=256 x 4,000 tokens"
    )
    await registry.aclose()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-release", action="store_true", help="no memory release")
    asyncio.run(main(not parser.parse_args().no_release))
