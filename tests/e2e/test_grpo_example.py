"""`examples/grpo.py` on the default model: two GRPO steps against a real server, each one
sampling with the policy the step before pushed, its behaviour log-probs equal to the
trainer's own forward (the importance ratio starts at 1); with --restore the server serves the
weights it started with afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.config_groups import DEFAULT_MODEL
from tests.e2e.server import running_server

pytestmark = pytest.mark.slow
EXAMPLE = Path(__file__).parents[2] / "examples" / "grpo.py"


@dataclass
class Run:
    """One run of the example against a fresh server on the default model."""

    done: subprocess.CompletedProcess[str]
    before: Any  # /v1/logprobs of a probe, before the run
    after: Any  # and after it
    adapters: list[Any]  # what GET /v1/adapters lists after it
    records: list[dict[str, Any]]  # the example's --log


def run_example(tmp_path: Path, *flags: str) -> Run:
    """Two steps of 2 groups of 4 replies, with `flags`."""
    env = {
        "RLSERVE_MODELS__MODEL": DEFAULT_MODEL,
        "RLSERVE_STORAGE__DATA_DIR": str(tmp_path),
        "RLSERVE_MODELS__BACKEND": "transformers",
        "RLSERVE_MODELS__LOAD_REFERENCE": "false",
    }
    log = tmp_path / "steps.jsonl"
    probe = {"prompt_text": ["What is 7 + 5?"], "response_text": [" 12"]}
    with running_server(env=env, log=tmp_path / "server.log", ready_timeout=300) as server:
        before = httpx.post(f"{server.url}/v1/logprobs", json=probe, timeout=60).json()
        command = [
            *[sys.executable, str(EXAMPLE), "--url", server.url, "--steps", "2", *flags],
            *["--prompts", "2", "--group-size", "4", "--log", str(log)],
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        after = httpx.post(f"{server.url}/v1/logprobs", json=probe, timeout=60).json()
        adapters = httpx.get(f"{server.url}/v1/adapters", timeout=60).json()["adapters"]
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return Run(done, before, after, adapters, records)


def test_grpo_example_takes_steps_and_pushes_weights(tmp_path):
    run = run_example(tmp_path, "--restore")
    done, before, after, records = run.done, run.before, run.after, run.records
    assert done.stdout.splitlines()[-1] == "restored the starting weights as policy version 3"
    assert (before["policy_version"], after["policy_version"]) == (0, 3)
    assert after["outputs"] == before["outputs"]
    assert [r["step"] for r in records] == [0, 1]
    assert [r["policy_version"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["reward"] <= 1.0
        assert record["behaviour_drift"] < 1e-3  # the ratio starts at 1 (measured: 3e-5)
    assert done.stdout.splitlines()[1].startswith("step   1  reward ")


def test_grpo_example_trains_a_lora_adapter_and_leaves_the_policy_as_it_was(tmp_path):
    """--lora: the rollouts sample with the adapter, whose pushes are its versions 1 and 2;
    the sampled log-probs equal the trainer's PEFT forward of the same adapter (a nonzero one
    from the second step on); the policy is untouched, the adapter unloaded at the end."""
    run = run_example(tmp_path, "--lora")
    done, records = run.done, run.records
    assert done.stdout.splitlines()[-1] == "unloaded the adapter grpo-lora; the policy is as it was"
    assert run.after == run.before and run.adapters == []
    assert [r["policy_version"] for r in records] == [1, 2]
    for record in records:
        assert 0.0 <= record["reward"] <= 1.0
        assert record["behaviour_drift"] < 1e-3
        assert record["grad_norm"] > 0.0
