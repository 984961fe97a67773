"""Uploaded datasets and the ifeval reward, in process (no model is needed: the app runs on
stand-in models): upload time and rows/s for GSM8K-shaped and IFEval-shaped JSONL (parse,
check, store), the first reset that draws from an upload (read and decode from the store) and
the next ones (cached), creating a session on it (which reads every row and checks it for
the reward, once per dataset and reward), and the ifeval reward's cost per scored response
next to gsm8k's.

    python bench/datasets.py            # 100,000 rows (the default row limit)
    python bench/datasets.py --quick    # 2,000 rows
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from common import ROOT, bench_arguments

sys.path.insert(0, str(ROOT))
from app.datasets.bundled import arithmetic_problems, ifeval_problems
from app.envs import ifeval
from app.envs.rewards import Sample, score_reward
from tests.fake.backend import FakeBackend, fake_app

IFEVAL_MAP = {
    "query": "prompt",
    "answer": None,
    "extra": {"instruction_id_list": "instruction_id_list", "kwargs": "kwargs"},
}


def gsm8k_jsonl(rows: int) -> str:
    problems = arithmetic_problems(rows, seed=1)
    return "\n".join(json.dumps({"question": p.query, "answer": p.answer}) for p in problems)


def ifeval_jsonl(rows: int) -> str:
    bundled = ifeval_problems()
    lines = []
    for i in range(rows):
        p = bundled[i % len(bundled)]
        lines.append(json.dumps({"prompt": f"{p.query} ({i})", **p.fields}))
    return "\n".join(lines)


async def timed(client: httpx.AsyncClient, method: str, path: str, body: Any = None) -> float:
    start = time.perf_counter()
    response = await client.request(method, path, json=body)
    assert response.is_success, response.text
    return time.perf_counter() - start


async def uploads(rows: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.5)
        async with fake_app(Path(tmp), *pair, http={"max_body_bytes": 256 << 20}) as app:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
                cases = {
                    "gsm8k": (gsm8k_jsonl(rows), {"query": "question"}, None, "gsm8k"),
                    "ifeval": (ifeval_jsonl(rows), IFEVAL_MAP, "ifeval", "ifeval"),
                }
                for name, (text, fields, check, reward) in cases.items():
                    name = f"{name}-shaped"
                    body = {"name": name, "jsonl": text, "fields": fields, "reward": check}
                    seconds = await timed(client, "POST", "/v1/datasets", body)
                    env = {"dataset": name, "reward": reward, "batch_size": 8}
                    start = time.perf_counter()
                    created = await client.post("/v1/envs", json=env)
                    create_s = time.perf_counter() - start
                    env_id = created.json()["env_id"]
                    first = await timed(client, "POST", f"/v1/envs/{env_id}/reset", {})
                    later = [
                        await timed(client, "POST", f"/v1/envs/{env_id}/reset", {})
                        for _ in range(5)
                    ]
                    out[name.removesuffix("-shaped")] = {
                        "rows": rows,
                        "megabytes": round(len(text.encode()) / 1e6, 2),
                        "checked_for_reward": check,
                        "upload_s": round(seconds, 3),
                        "rows_per_s": round(rows / seconds),
                        "session_create_s": round(create_s, 3),
                        "first_reset_s": round(first, 4),
                        "cached_reset_s": round(statistics.median(later), 4),
                    }
    return out


def scoring(repeats: int) -> dict[str, Any]:
    """Seconds per scored response (the median over `repeats` rounds of every bundled row)."""
    ifeval.checks()  # loaded once per process; the import is timed apart
    problems = ifeval_problems()
    responses = [
        f"<think>ok</think><answer>{p.query} Here is a reply, with some words.</answer>"
        for p in problems
    ]
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for p, r in zip(problems, responses, strict=True):
            score_reward("ifeval", {}, Sample(r, prompt=p.query, fields=p.fields))
        rounds.append((time.perf_counter() - start) / len(problems))
    gsm = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(len(problems)):
            score_reward("gsm8k", {}, Sample("<answer>1,000</answer>", "#### 1000"))
        gsm.append((time.perf_counter() - start) / len(problems))
    return {
        "ifeval_ms_per_response": round(statistics.median(rounds) * 1e3, 3),
        "gsm8k_ms_per_response": round(statistics.median(gsm) * 1e3, 4),
    }


def main() -> None:
    started = time.perf_counter()
    problem = ifeval.unavailable()
    import_s = time.perf_counter() - started
    if problem is not None:
        raise SystemExit(f"the ifeval extra is needed: {problem}")
    rows = 2_000 if ARGS.quick else 100_000
    report = {
        "rows": rows,
        "ifeval_checks_import_s": round(import_s, 2),
        "uploads": asyncio.run(uploads(rows)),
        "scoring": scoring(3 if ARGS.quick else 20),
    }
    name = "datasets-quick" if ARGS.quick else "datasets"
    ARGS.output.mkdir(parents=True, exist_ok=True)
    (ARGS.output / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    parser = bench_arguments(__doc__)
    ARGS = parser.parse_args()
    main()
