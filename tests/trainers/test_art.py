"""ART 0.5.23's own client path (openpipe-art from PyPI, unmodified) against a real rlserve: a
TrainableModel's OpenAI client (it adds return_token_ids, return_tokens_as_token_ids, nvext and
chat_template_kwargs to each call), trajectories captured by art.trajectory_group and gathered
the older way, and ART's tokenizing of them for training, whose tokens and log-probs must be
the server's: the prompt as /tokenize renders it, the sampled ids, and the log-probs
/v1/logprobs gives for them. ART needs Python 3.12: its side runs in .venv-art
(`tests/trainers/art_driver.py`), the server and these checks in .venv-trainers."""

from __future__ import annotations

import json
import os
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
            [str(ART), str(Path(__file__).with_name("art_driver.py")), server.url, "capture"],
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


ART_0518 = ROOT / ".venv-trainers" / "art-0.5.18"
"""ART 0.5.18, the newest release for Python 3.11, installed apart
(scripts/setup-trainers.sh): it runs in .venv-trainers, whose Python is 3.11."""


def step_adapters(source: str, root: Path) -> list[tuple[Path, Any]]:
    """Three training steps' LoRA adapters, as ART's checkpoints hold them: step 0 the
    untrained one (B zero: the base model), then two trained ones."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    built = []
    for step in range(3):
        base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        torch.manual_seed(step)
        config = LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=step == 0
        )
        model = get_peft_model(base, config).eval()
        model.save_pretrained(root / f"{step:04d}", save_embedding_layers=False)
        built.append((root / f"{step:04d}", model))
    return built


@pytest.mark.parametrize("release", ["0.5.18", "0.5.23"])
def test_art_rollouts_under_each_steps_name_train_on_the_served_ids(release, tmp_path):
    """ART's loop over three training steps with its own code, on the newest release for
    Python 3.11 (0.5.18) and the newest (0.5.23), against a server started as ART starts its
    vLLM (`--return-tokens-as-token-ids`): after each step's adapter is pushed, rollouts name
    the model as ART names the step (NAME@STEP), which serves that version of the adapter
    (PEFT's forward of it computes the log-probs), and the ids ART tokenizes for training are
    the served ones. 0.5.18 reads them back from the log-prob tokens' names alone."""
    from tests.conftest import forward_log_probs

    if release == "0.5.18":
        python, path = ROOT / ".venv-trainers" / "bin" / "python", ART_0518
    else:
        python, path = ART, None
    if not python.exists() or (path is not None and not path.exists()):
        pytest.skip(f"ART {release} is not installed (scripts/setup-trainers.sh)")
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp_path), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    if release == "0.5.18":
        # 0.5.18 finds the reply's place in the chat template by a sentinel token, the
        # vocabulary's last regular token, which must decode and encode back to itself: a
        # real tokenizer's does, not the tiny model's lone bytes. The default model, then.
        env["RLSERVE_MODELS__MODEL"] = "builtin:smollm2-135m-instruct"
    log = tmp_path / "server.log"
    with running_server("--return-tokens-as-token-ids", env=env, log=log) as server:
        source = httpx.get(f"{server.url}/v1/models").json()["data"][0]["source"]
        adapters = step_adapters(source, tmp_path / "checkpoints")
        driver = [str(python), str(Path(__file__).with_name("art_driver.py")), server.url]
        pythonpath = os.pathsep.join(str(p) for p in (path, ROOT) if p is not None)
        ran = subprocess.run(
            [*driver, "steps", release, source, *(str(folder) for folder, _ in adapters)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={
                "HOME": str(tmp_path),
                "PATH": "/usr/bin:/bin",
                "WANDB_MODE": "disabled",
                "PYTHONPATH": pythonpath,
            },
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        out = json.loads(ran.stdout.strip().splitlines()[-1])
        assert path is None or out["art"].startswith(str(path))
        prompt = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
        for step, record in enumerate(out["steps"]):
            assert record["name"] == f"agent@{step}"
            _, peft_model = adapters[step]
            assert len(record["trajectories"]) == 4
            for trajectory in record["trajectories"]:
                served = trajectory["served"]
                assert 1 <= len(served) <= 8
                assert trajectory["tokens"] == prompt + served
                assert trajectory["sampled"] == list(range(len(prompt), len(prompt) + len(served)))
                values = [trajectory["logprobs"][i] for i in trajectory["sampled"]]
                expected = forward_log_probs(peft_model, trajectory["tokens"])[len(prompt) :]
                assert_close(values, expected, 1e-4)
        gone = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "agent@0", "messages": MESSAGES, "max_tokens": 1},
        )
        assert gone.status_code == 404 and "resident: [1, 2]" in gone.text
