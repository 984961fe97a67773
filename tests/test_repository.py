"""What a clone carries: code, docs and figures, never models, caches or venvs. Every byte
committed stays in every clone forever, so a tracked file over MAX_BYTES (a model's weights, a
benchmark's cache) fails here before it lands."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 4 << 20


def test_no_tracked_file_is_over_a_few_megabytes() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    tracked = [ROOT / name for name in listed.split("\0") if name]
    assert len(tracked) > 100
    large = {
        str(path.relative_to(ROOT)): path.stat().st_size
        for path in tracked
        if path.is_file() and path.stat().st_size > MAX_BYTES
    }
    assert not large, f"tracked files over {MAX_BYTES} bytes (ignore them instead): {large}"


def test_benchmark_caches_are_ignored() -> None:
    """bench/ scripts build models and data into hidden folders of bench/results (a reward
    model of benchmark size: 95 MB): git ignores every one of them."""
    for cache in (".reward-v5-h512-l6/model.safetensors", ".model-x/a", ".reward-smollm2/b"):
        path = f"bench/results/{cache}"
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode
        assert ignored == 0, f"{path} is not ignored"
