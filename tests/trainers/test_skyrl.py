"""SkyRL 0.4.0's own `RemoteInferenceClient` (from its PyPI release, unmodified) against a real
rlserve started with the model name SkyRL is configured with: generation as its generator asks
(min_tokens 1, a stop id, skip_special_tokens, include_stop_str_in_output), the detokenizing it
does over HTTP, its Tinker-style `sample` with prompt log-probs, tokenize, pause and resume, the
world size and the prefix-cache reset. SkyRL needs Python 3.12: the client runs in .venv-skyrl
(`tests/trainers/skyrl_driver.py`), the server and these checks in .venv-trainers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.conftest import assert_close
from tests.e2e.server import running_server

pytestmark = pytest.mark.trainers
ROOT = Path(__file__).resolve().parents[2]
SKYRL = ROOT / ".venv-skyrl" / "bin" / "python"
NAME = "Qwen/Qwen3-0.6B"  # what SkyRL's config names (generator.inference_engine.served_model_name)


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:  # type: ignore[type-arg]
    if not SKYRL.exists():
        pytest.skip("no .venv-skyrl (SkyRL needs Python 3.12: scripts/setup-trainers.sh)")
    tmp = tmp_path_factory.mktemp("skyrl")
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    with running_server("--served-model-name", NAME, env=env, log=tmp / "server.log") as server:
        stop = httpx.get(f"{server.url}/v1/models").json()["data"][0]["pad_token_id"]
        ran = subprocess.run(
            [
                str(SKYRL),
                str(Path(__file__).with_name("skyrl_driver.py")),
                server.url,
                NAME,
                str(stop),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        out = json.loads(ran.stdout.strip().splitlines()[-1])
        yield server.url, out


def scored(url: str, sequence: list[int]) -> list[float]:
    body = httpx.post(f"{url}/v1/logprobs", json={"tokens": [sequence]}).json()
    return body["outputs"][0]["log_probs"]["full"]  # type: ignore[no-any-return]


def test_a_model_name_not_served_is_404_naming_the_flag(answers):
    """SkyRL's model name without --served-model-name for it: 404 as vLLM answers, and the
    message SkyRL raises names the flag that serves it."""
    _, out = answers
    assert out["unnamed"]["status"] == 404, out["unnamed"]
    assert "--served-model-name" in out["unnamed"]["error"], out["unnamed"]


def test_skyrl_generates_detokenizes_and_parses_log_probs(answers):
    url, out = answers
    generated = out["generate"]
    for prompt, ids, values, text, reason in zip(
        [[5, 6, 7, 8], [40, 41]],
        generated["response_ids"],
        generated["response_logprobs"],
        generated["responses"],
        generated["stop_reasons"],
        strict=True,
    ):
        assert 1 <= len(ids) <= 8 and reason in ("stop", "length")
        assert_close(values, scored(url, prompt + ids)[len(prompt) :], 1e-4)
        assert text == httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"]


def test_skyrl_samples_with_prompt_log_probs(answers):
    url, out = answers
    prompt = [5, 6, 7, 8, 9]
    sample = out["sample"]
    assert len(sample["sequences"]) == 2
    for sequence in sample["sequences"]:
        tokens = sequence["tokens"]
        assert_close(sequence["logprobs"], scored(url, prompt + tokens)[len(prompt) :], 1e-4)
    own = scored(url, prompt)
    assert sample["prompt_logprobs"][0] is None
    assert_close(sample["prompt_logprobs"][1:], own[1:], 1e-4)
    for top in sample["topk_prompt_logprobs"][1:]:
        assert len(top) == 2 and top[0][1] >= top[1][1]


def test_skyrl_controls_and_tokenizes(answers):
    url, out = answers
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "2 + 3 ="}).json()["tokens"]
    assert out["tokenize"] == [tokens]
    assert out["detokenize"] == ["abc"]
    assert out["paused"] and out["resumed"]
    assert out["world_size"] == [1, 1]


SKYRL_030 = ROOT / ".venv-skyrl" / "skyrl-0.3.0"
"""SkyRL 0.3.0, installed apart (scripts/setup-trainers.sh): it does not import on Python
3.11, and the venv's own SkyRL is 0.4.0."""


@pytest.mark.parametrize("release", ["0.3.0", "0.4.0"])
def test_skyrls_weight_sync_loop_ends_serving_the_trainers_weights(release, tmp_path):
    """Three GRPO steps as SkyRL's trainer runs them against an external server, its own code
    on both releases: 0.3.0's `BroadcastWeightTransferSender` (/collective_rpc: start,
    update_weights_nccl with its packed update info, finish), 0.4.0's `SkyrlWeightSyncClient`
    (vLLM's routes, the packing on each update info). Every step samples with the weights
    pushed last (the log-probs are the trainer's own forward of them), each push is one
    version, and the server ends serving the trainer's weights."""
    if not SKYRL.exists():
        pytest.skip("no .venv-skyrl (SkyRL needs Python 3.12: scripts/setup-trainers.sh)")
    if release == "0.3.0" and not SKYRL_030.exists():
        pytest.skip("no .venv-skyrl/skyrl-0.3.0 (scripts/setup-trainers.sh)")
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp_path), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    with running_server(
        "--served-model-name", NAME, env=env, log=tmp_path / "server.log"
    ) as server:
        card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
        stop, source = card["pad_token_id"], card["source"]
        here = Path(__file__).parent
        if release == "0.3.0":
            command = [str(here / "skyrl030_driver.py"), server.url, NAME, str(stop), source]
            path = f"{SKYRL_030}{os.pathsep}{ROOT}"
        else:
            command = [str(here / "skyrl_driver.py"), server.url, NAME, str(stop), "loop", source]
            path = str(ROOT)
        ran = subprocess.run(
            [str(SKYRL), *command],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        out = json.loads(ran.stdout.strip().splitlines()[-1])
        if release == "0.3.0":
            assert out["skyrl"].startswith(str(SKYRL_030))
        assert len(out["steps"]) == 3
        for step in out["steps"]:
            for sampled, own, ids in zip(step["sampled"], step["own"], step["ids"], strict=True):
                assert 1 <= len(ids) <= 6 and len(sampled) == len(ids)
                assert_close(sampled, own, 1e-4)
        assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": "3"}
        for sequence, own in zip(out["final"]["sequences"], out["final"]["own"], strict=True):
            assert_close(scored(server.url, sequence)[1:], own, 1e-4)
        if release == "0.3.0":
            log = (tmp_path / "server.log").read_text()
            assert log.count("POST /collective_rpc 200") == 9


def test_skyrls_checkpoint_deltas_end_serving_the_trainers_weights(tmp_path):
    """SkyRL 0.4.0's checkpoint-delta backend, its own publisher, engine and HTTP client
    (`tests/trainers/skyrl_delta_driver.py`): three steps, each published as an XOR delta of
    the one before and pulled by the server (POST /fetch_weights, before the pause) into a
    local checkpoint seeded from the model it started with, then loaded (POST
    /update_weights) between SkyRL's pause and resume. After each step the server's
    log-probs are the trainer's own forward's, and each step is one version."""
    if not SKYRL.exists():
        pytest.skip("no .venv-skyrl (SkyRL needs Python 3.12: scripts/setup-trainers.sh)")
    env = {"RLSERVE_STORAGE__DATA_DIR": str(tmp_path), "RLSERVE_MODELS__LOAD_REFERENCE": "false"}
    with running_server(env=env, log=tmp_path / "server.log") as server:
        source = httpx.get(f"{server.url}/v1/models").json()["data"][0]["source"]
        driver = Path(__file__).with_name("skyrl_delta_driver.py")
        ran = subprocess.run(
            [str(SKYRL), str(driver), server.url, source, str(tmp_path / "sync")],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert ran.returncode == 0, ran.stderr[-4000:]
        out = json.loads(ran.stdout.strip().splitlines()[-1])
        assert out["published"] == ["delta-00000001", "delta-00000002", "delta-00000003"]
        for step in out["steps"]:
            assert_close(step["served"], step["own"], 1e-4)
        assert httpx.get(f"{server.url}/weight_info").json() == {"weight_version": "3"}
        log = (tmp_path / "server.log").read_text()
        order = [
            line.split("POST ")[1].split(" ")[0].split("?")[0]
            for line in log.splitlines()
            if "POST /" in line and "/v1/logprobs" not in line
        ]
        step = [
            "/fetch_weights",
            "/pause",
            "/reset_prefix_cache",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        assert order == ["/init_weight_transfer_engine", *step * 3]
