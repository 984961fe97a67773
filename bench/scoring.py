"""/v1/logprobs as JSON and as binary (safetensors) bodies, through the Python client against
a real server: 64 sequences x 2,048 tokens scored on the built-in model, with and without the
20 most likely tokens at every position. Per case: bytes on the wire (request and reply), the
server's CPU seconds for the request, and end-to-end seconds until the caller holds tensors
(a TensorDict of the samples plus the top-k table), the median of `--repeats` calls.

    python bench/scoring.py            # 64 x 2,048 tokens
    python bench/scoring.py --quick    # 4 x 128 tokens smoke run
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from common import bench_arguments, running_server
from rlserve_client import Client
from rlserve_client.types import LogProbsResult

VOCAB = 259  # the built-in model's


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (every thread)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0  # utime, stime in clock ticks (USER_HZ)


def tensors(result: LogProbsResult, top: int) -> dict[str, torch.Tensor]:
    """What a trainer holds afterwards: the padded samples and the top-k table."""
    td = result.to_tensordict()
    out = {"log_probs": td.get(("log_probs", "full")), "tokens": td.get(("tokens", "full"))}
    if top:
        ids = [o.top_logprobs.ids for o in result.outputs]  # type: ignore[union-attr]
        values = [o.top_logprobs.log_probs for o in result.outputs]  # type: ignore[union-attr]
        out["top_ids"] = torch.stack([_table(rows, torch.long, -1) for rows in ids])
        out["top_log_probs"] = torch.stack([_table(rows, torch.float32, 0.0) for rows in values])
    return out


def _table(rows: Any, dtype: torch.dtype, fill: Any) -> torch.Tensor:
    """One sequence's top-k rows; JSON gives lists with a null first row."""
    if isinstance(rows, torch.Tensor):  # binary: the first row (no prediction) is NaN / -1
        return rows.to(dtype).nan_to_num(nan=fill)
    width = len(next(r for r in rows if r is not None))
    return torch.tensor([[fill] * width if r is None else r for r in rows], dtype=dtype)


class Counter:
    """Bytes each way, counted by httpx event hooks on the client's own connection."""

    def __init__(self) -> None:
        self.sent = self.received = 0

    def request(self, request: Any) -> None:
        self.sent += len(request.content)

    def response(self, response: Any) -> None:
        response.read()
        self.received += len(response.content)


def measure(
    client: Client, counter: Counter, pid: int, rows: torch.Tensor, top: int, binary: bool
) -> dict[str, Any]:
    tokens: Any = list(rows) if binary else rows.tolist()
    asks = {"top_logprobs": top} if top else {}
    runs: list[dict[str, float]] = []
    for _ in range(ARGS.repeats):
        counter.sent = counter.received = 0
        cpu = cpu_seconds(pid)
        start = time.perf_counter()
        result = client.logprobs(tokens=tokens, tensors=binary, **asks)
        held = tensors(result, top)
        seconds = time.perf_counter() - start
        server_cpu = cpu_seconds(pid) - cpu
        runs.append(
            {
                "seconds": seconds,
                "server_cpu_s": server_cpu,
                "request_bytes": counter.sent,
                "reply_bytes": counter.received,
            }
        )
    assert held["log_probs"].shape == rows.shape
    return {
        "seconds": round(statistics.median(r["seconds"] for r in runs), 3),
        "server_cpu_s": round(statistics.median(r["server_cpu_s"] for r in runs), 3),
        "request_bytes": runs[-1]["request_bytes"],
        "reply_bytes": runs[-1]["reply_bytes"],
        "runs_s": [round(r["seconds"], 3) for r in runs],
        "held": held,
    }


def main() -> None:
    sequences, length = (4, 128) if ARGS.quick else (64, 2048)
    rows = torch.randint(0, VOCAB, (sequences, length), generator=torch.Generator().manual_seed(0))
    ARGS.output.mkdir(parents=True, exist_ok=True)
    env = {
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_STORAGE__DATA_DIR": str(ARGS.output / ".data"),
        "RLSERVE_MODELS__MAX_MODEL_LEN": str(max(length, 256)),
    }
    counter = Counter()
    cases: dict[str, dict[str, Any]] = {}
    with running_server(env=env, log=ARGS.output / "scoring-server.log") as server:
        hooks = {"request": [counter.request], "response": [counter.response]}
        with Client(base_url=server.url, timeout=600) as client:
            client._http.event_hooks = hooks
            client.logprobs(tokens=rows[:1].tolist())  # warm-up
            for top in (0, 20):
                for binary in (False, True):
                    name = f"{'binary' if binary else 'json'}{f'_top{top}' if top else ''}"
                    cases[name] = measure(client, counter, server.process.pid, rows, top, binary)
    for top in ("", "_top20"):
        plain, packed = cases[f"json{top}"].pop("held"), cases[f"binary{top}"].pop("held")
        for key in plain:  # both paths hand the trainer the same numbers
            assert torch.equal(plain[key], packed[key]), f"json{top} and binary{top}: {key}"

    def ratio(top: str, key: str) -> float:
        return round(cases[f"json{top}"][key] / max(cases[f"binary{top}"][key], 1e-3), 2)

    ratios = {
        top or "_plain": {
            "faster": round(cases[f"json{top}"]["seconds"] / cases[f"binary{top}"]["seconds"], 2),
            "smaller": round(
                cases[f"json{top}"]["reply_bytes"] / cases[f"binary{top}"]["reply_bytes"], 2
            ),
            "server_cpu": round(
                cases[f"json{top}"]["server_cpu_s"]
                / max(cases[f"binary{top}"]["server_cpu_s"], 1e-3),
                2,
            ),
        }
        for top in ("", "_top20")
    }
    report = {
        "setup": f"{sequences} sequences x {length} tokens, built-in model (vocab {VOCAB}), "
        "CPU, client and server on one host",
        "cases": cases,
        "binary_vs_json": ratios,
        "goals": {
            "top20_binary_at_least_3x_faster": ratios["_top20"]["faster"] >= 3,
            "top20_binary_at_least_5x_smaller": ratios["_top20"]["smaller"] >= 5,
        },
    }
    name = "scoring-quick" if ARGS.quick else "scoring"
    (ARGS.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = bench_arguments(__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    ARGS = parser.parse_args()
    main()
