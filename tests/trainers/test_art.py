"""ART 0.5.23's own client path (openpipe-art from PyPI, unmodified) against a real rlserve: a
TrainableModel's OpenAI client (it adds return_token_ids, return_tokens_as_token_ids, nvext and
chat_template_kwargs to each call), trajectories captured by art.trajectory_group and gathered
the older way, and ART's tokenizing of them for training, whose tokens and log-probs must be
the server's: the prompt as /tokenize renders it, the sampled ids, and the log-probs
/v1/logprobs gives for them. ART needs Python 3.12: its side runs in .venv-art
(`tests/trainers/art_driver.py`), the server and these checks in .venv-trainers."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import assert_close
from tests.e2e.server import running_server

pytestmark = pytest.mark.trainers
ROOT = Path(__file__).resolve().parents[2]
ART = ROOT / ".venv-art" / "bin" / "python"
MESSAGES = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, Any]]]:
    if not ART.exists():
        pytest.skip("no .venv-art (ART needs Python 3.12: scripts/setup-trainers.sh)")
    tmp = tmp_path_factory.mktemp("art")
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    with running_server(env=env, log=tmp / "server.log") as server:
        ran = subprocess.run(
            [str(ART), str(Path(__file__).with_name("art_driver.py")), server.url],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp,
            env={"HOME": str(tmp), "PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled"},
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        yield server.url, json.loads(ran.stdout.strip().splitlines()[-1])


def scored(url: str, sequence: list[int]) -> list[float]:
    body = httpx.post(f"{url}/v1/logprobs", json={"tokens": [sequence]}).json()
    return body["outputs"][0]["log_probs"]["full"]  # type: ignore[no-any-return]


def check_tokenized(
    url: str, prompt: list[int], sampled: list[int], trajectory: dict[str, Any]
) -> list[float]:
    """ART's training tokens are the prompt, then the sampled ids, flagged as sampled, with
    no log-prob for the prompt and the server's scores for the sampled ones (returned)."""
    assert trajectory["tokens"] == prompt + sampled
    assert trajectory["sampled"] == list(range(len(prompt), len(prompt) + len(sampled)))
    assert all(v is None for v in trajectory["logprobs"][: len(prompt)])
    values = [trajectory["logprobs"][i] for i in trajectory["sampled"]]
    assert_close(values, scored(url, trajectory["tokens"])[len(prompt) :], 1e-4)
    return values


def test_art_tokenizes_captured_trajectories_as_the_server_sampled_them(answers):
    url, out = answers
    prompt = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert len(out["captured"]) == 4
    for trajectory in out["captured"]:
        reply = trajectory["reply"]
        sampled = reply["token_ids"]
        assert reply["prompt_token_ids"] == prompt and 1 <= len(sampled) <= 8
        assert reply["tokens"] == [f"token_id:{t}" for t in sampled]
        assert check_tokenized(url, prompt, sampled, trajectory) == reply["logprobs"]
    assert len({tuple(t["reply"]["token_ids"]) for t in out["captured"]}) > 1  # seeds differ


def test_art_tokenizes_gathered_trajectories_too(answers):
    url, out = answers
    prompt = httpx.post(f"{url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert len(out["legacy"]) == 2
    for trajectory in out["legacy"]:
        check_tokenized(url, prompt, trajectory["token_ids"], trajectory)
