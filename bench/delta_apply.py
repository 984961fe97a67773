"""Where a delta's apply spends its time: a SmolLM2-135M-sized state (random weights, the
model's tensor shapes) with a share of its elements moved, encoded by the client's
`DeltaEncoder`, then applied as the server does (`app.weights.delta.stage`, then
`write_changes`, the commit), best of 4; and the same work one step at a time on one core:
reading the served bytes, decompressing each change, the scatter, the NaN check of the
changed elements, the hash, the commit's scatter. The limit is this host's memory-copy
bandwidth, measured in the same run (`torch`'s copy). Writes `bench/results/delta_apply.json`.

    python bench/delta_apply.py [--share 0.048] [--dtype bfloat16] [--quick]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import bench_arguments, copy_bandwidth, save_report
from rlserve_client import weight_delta as codec
from rlserve_client.weight_delta import DeltaEncoder

from app.common.roles import Role
from app.weights import delta
from app.weights.checkpoint import layout_of_state

SHAPES = [(49152, 576)] + [(576, 576)] * 60 + [(1536, 576)] * 90 + [(576,)] * 61
"""SmolLM2-135M's tensors: the embedding, attention, MLP and norm weights of 30 layers."""


def states(share: float, dtype: torch.dtype, layers: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A served state and the next one: `share` of its elements moved by a few percent (in
    bfloat16, as an optimizer step moves the elements that change at all)."""
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES if layers >= 30 else SHAPES[: 1 + 5 * layers]
    served = {f"t{i}": (torch.randn(s, generator=g) * 0.02).to(dtype) for i, s in enumerate(shapes)}
    new = {}
    for name, tensor in served.items():
        x = tensor.float()
        moved = torch.rand(x.shape, generator=g) < share
        nudged = x * (1 + 0.03 * torch.randn(x.shape, generator=g))
        new[name] = torch.where(moved, nudged, x).to(dtype)
    return served, new


def applied(path: Path, served: dict[str, Any], new: dict[str, Any]) -> tuple[float, float]:
    """Seconds to stage and to commit, on a fresh copy of the served state."""
    state = {k: v.clone() for k, v in served.items()}
    start = time.perf_counter()
    staged = delta.stage(delta.read_delta(path, Role.UPLOAD), layout_of_state(state), state.get, 0)
    staged_at = time.perf_counter()
    delta.write_changes(state, staged.changes)
    done = time.perf_counter()
    assert all(torch.equal(state[k], new[k]) for k in state), "the apply rebuilt other values"
    return staged_at - start, done - staged_at


def steps(path: Path, served: dict[str, Any]) -> dict[str, float]:
    """The apply's work one step at a time on one core, in seconds (an overwrite change's
    steps; an xor change's XOR counts as its scatter)."""
    spent = dict.fromkeys(("read", "decompress", "scatter", "nan_check", "hash", "commit"), 0.0)
    found = delta.read_delta(path, Role.UPLOAD)

    def timed(step: str, work: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = work(*args)
        spent[step] += time.perf_counter() - start
        return out

    for part in found.parts:
        tensor = served[part.name]
        old = tensor.reshape(-1).view(torch.uint8).numpy()
        with part.path.open("rb") as f:
            f.seek(part.offset)
            frame = f.read(part.size)
        digest = codec.hasher(codec.DIGEST)
        if part.encoding != "overwrite":
            payload = timed("decompress", codec.xor_payload, frame, old.size)
            new = timed("scatter", np.bitwise_xor, old, payload)
            timed("hash", digest.update, new)
            continue
        positions, values = timed("decompress", codec.overwrites, frame, old.size)
        exponent = delta._EXPONENT.get(tensor.dtype)
        scratch = np.empty(min(delta.BLOCK_BYTES, old.size), np.uint8)
        bounds = np.searchsorted(positions, [*delta._blocks(old.size), old.size])
        for i, start in enumerate(delta._blocks(old.size)):
            block = scratch[: min(delta.BLOCK_BYTES, old.size - start)]
            timed("read", np.copyto, block, old[start : start + block.size])
            inside = positions[bounds[i] : bounds[i + 1]] - start
            timed("scatter", block.__setitem__, inside, values[bounds[i] : bounds[i + 1]])
            timed("nan_check", delta.touched_nonfinite, block, inside, exponent)
            timed("hash", digest.update, block)
        target = old.copy()
        timed("commit", target.__setitem__, positions, values)
    return spent


def main() -> None:
    parser = bench_arguments(__doc__)
    parser.add_argument("--share", type=float, default=0.048, help="elements moved")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    served, new = states(args.share, dtype, 2 if args.quick else 30)
    nbytes = sum(t.numel() * t.element_size() for t in served.values())
    moved = sum(int((new[k] != served[k]).sum()) for k in served)
    encoder = DeltaEncoder()
    encoder.remember(served, 0, None)
    blob = encoder.encode(new).blob
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.delta"
        path.write_bytes(blob)
        stage_s, commit_s = min((applied(path, served, new) for _ in range(4)), key=sum)
        spent = steps(path, served)
    bandwidth = copy_bandwidth()
    speed = nbytes / (stage_s + commit_s)
    report = {
        "state": f"SmolLM2-135M's tensor shapes, {args.dtype}, random weights, CPU",
        "weights_mb": round(nbytes / 1e6, 1),
        "elements_changed": round(moved / sum(t.numel() for t in served.values()), 4),
        "delta_mb": round(len(blob) / 1e6, 1),
        "stage_ms": round(stage_s * 1e3, 1),
        "commit_ms": round(commit_s * 1e3, 1),
        "apply_gb_per_s": round(speed / 1e9, 3),
        "memory_copy_gb_per_s": round(bandwidth / 1e9, 3),
        "apply_share_of_copy_bandwidth": round(speed / bandwidth, 3),
        "one_core_ms": {step: round(s * 1e3, 1) for step, s in spent.items()},
    }
    save_report(args, "delta_apply", report)
    for key, value in report.items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
