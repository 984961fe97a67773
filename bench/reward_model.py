"""The reward model served beside the policy, against the same model in-process: rewards per
second at 1, 8 and 32 concurrent clients, each request one sequence of `--tokens` tokens on
`/v1/rewards`, and in-process `AutoModelForSequenceClassification` forwards of batches of the
same size (as many sequences as clients: what the server's batcher can put in one call). The
server's rewards are checked against the in-process ones (1e-5).

    python bench/reward_model.py            # a 512-wide, 6-layer reward model, 128 requests
    python bench/reward_model.py --quick    # the built-in tiny one, a few requests
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from common import bench_arguments, drive, running_server
from transformers import AutoModelForSequenceClassification

from app.engine.builtin_model import BUILDER_VERSION, build_model

CLIENTS = (1, 8, 32)


def reward_model(output: Path, hidden: int, layers: int) -> Path:
    """A random-weights Qwen2 reward model of benchmark size, built once into `output`."""
    path = output / f".reward-v{BUILDER_VERSION}-h{hidden}-l{layers}"
    if not (path / "config.json").exists():
        build_model(path, hidden_size=hidden, num_layers=layers, reward=True)
    return path


@torch.inference_mode()
def in_process(path: Path, sequences: list[list[int]], batch: int) -> tuple[float, list[float]]:
    """Rewards per second of plain batched forwards (left-padded, as the server pads), and
    each sequence's reward."""
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    pad = int(model.config.pad_token_id)
    rewards: list[float] = []

    def run(chunk: list[list[int]]) -> list[float]:
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, width - len(s) :] = torch.tensor(s)
            mask[row, width - len(s) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(ids, attention_mask=mask, position_ids=positions).logits[:, 0].tolist()

    run(sequences[:batch])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(sequences), batch):
        rewards += run(sequences[i : i + batch])
    return len(sequences) / (time.perf_counter() - start), rewards


def main() -> None:
    output: Path = ARGS.output
    quick = ARGS.quick
    hidden, layers = (64, 2) if quick else (512, 6)
    requests, tokens = (16, 32) if quick else (ARGS.requests, ARGS.tokens)
    path = reward_model(output, hidden, layers)
    generator = torch.Generator().manual_seed(0)
    sequences = [
        torch.randint(0, 256, (tokens,), generator=generator).tolist() for _ in range(requests)
    ]
    env = {
        "RLSERVE_STORAGE__DATA_DIR": str(output / ".data"),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
        "RLSERVE_MODELS__REWARD_MODEL": str(path),
        "RLSERVE_BATCHING__MAX_BATCH_SIZE": "32",
    }
    served: dict[int, Any] = {}
    with running_server(env=env, log=output / ".reward_model-server.log") as server:
        bodies = [{"tokens": [s]} for s in sequences]
        for clients in CLIENTS:
            figures = asyncio.run(drive(server.url, "/v1/rewards", bodies, clients, tokens))
            served[clients] = figures.as_dict()
        answer = httpx.post(f"{server.url}/v1/rewards", json={"tokens": sequences}, timeout=600)
        server_rewards = [o["reward"] for o in answer.json()["outputs"]]
    results: dict[str, Any] = {
        "model": f"random-weights Qwen2 reward model, hidden {hidden}, {layers} layers, "
        "float32, CPU",
        "workload": {"requests": requests, "tokens_per_request": tokens},
        "rlserve": served,
        "in_process_rewards_per_s": {},
        "rlserve_over_in_process": {},
    }
    for clients in CLIENTS:
        rate, local = in_process(path, sequences, clients)
        results["in_process_rewards_per_s"][clients] = round(rate, 3)
        ratio = served[clients]["requests_per_s"] / rate
        results["rlserve_over_in_process"][clients] = round(ratio, 3)
        worst = max(abs(a - b) for a, b in zip(server_rewards, local, strict=True))
        assert worst <= 1e-5, f"served rewards differ from in-process by {worst}"
    results["max_abs_diff_vs_in_process"] = worst
    print(json.dumps(results, indent=1))
    name = "reward_model-quick.json" if quick else "reward_model.json"
    (output / name).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    parser = bench_arguments(__doc__)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=256)
    ARGS = parser.parse_args()
    main()
