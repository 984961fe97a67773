"""rlserve as 2 replicas on Ray Serve (a local Ray cluster) with sessions in a real
redis-server: requests spread over both replicas, each labels its answers and metrics, a
session's requests stick to one replica, and an environment episode survives that replica
being killed (Ray starts another; no completed step is lost). Weight updates (a load, an
upload, the collective transfer) reach both replicas or neither, and so do LoRA adapters. Each
replica serves the reward model beside its policy."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from rlserve_client._base import SESSION_HEADER

from tests.e2e.server import (
    Server,
    free_port,
    replicas_answering,
    running_process,
    wait_for_replicas,
)
from tests.stores.redis_server import running_redis

ray = pytest.importorskip("ray", reason="ray is installed with the distributed extra")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is missing"),
]
RAY = str(Path(sys.executable).parent / "ray")
# A local test cluster without token authentication (the servers and this test use it alike).
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DISABLE_USAGE_STATS": "1"}
AFFINITY_THRESHOLD = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray head node in the foreground (`--block`), stopped by its pid afterwards
    (which stops the processes it started); its address."""
    port = free_port()
    log = tmp_path_factory.mktemp("ray-head") / "head.log"
    command = [
        RAY,
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=4",
        "--include-dashboard=false",
    ]
    with log.open("wb") as sink:
        head = subprocess.Popen(
            command, env={**os.environ, **RAY_ENV}, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray did not start:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.terminate()
        head.wait(timeout=60)


@pytest.fixture(scope="module")
def server(cluster: str, tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("ray-serve")
    with running_redis(tmp) as redis_url:
        port = free_port()
        env = {
            "RAY_ADDRESS": cluster,
            **RAY_ENV,
            "RLSERVE_MODELS__CACHE_DIR": str(settings.models.cache_dir),
            "RLSERVE_STORAGE__DATA_DIR": str(tmp / "data"),
            "RLSERVE_STORAGE__SESSION_STORE": redis_url,
            "RLSERVE_MODELS__BACKEND": "transformers",
            "RLSERVE_MODELS__REWARD_MODEL": "builtin:tiny-reward",
        }
        command = [
            *[sys.executable, "-m", "app.cli", "serve", "--replicas", "2", "--sticky-sessions"],
            *["--affinity-threshold", str(AFFINITY_THRESHOLD), "--port", str(port)],
        ]
        with running_process(
            command, port, "/ready", env=env, log=tmp / "serve.log", timeout=300
        ) as running:
            wait_for_replicas(running.url, 2)
            yield running


def test_requests_spread_over_both_replicas(server: Server) -> None:
    seen = replicas_answering(server.url)
    assert len(seen) == 2
    labels = set()
    for _ in range(20):
        text = httpx.get(f"{server.url}/metrics", timeout=30).text
        labels |= {line for line in text.splitlines() if line.startswith("target_info{")}
    assert labels == {f'target_info{{replica="{r}"}} 1.0' for r in seen}


def test_every_replica_serves_the_reward_model(server: Server, settings) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from app.engine.loader import builtin_reward_dir

    path = builtin_reward_dir(settings.models)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    text = "The answer is 42."
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    with torch.inference_mode():
        expected = float(model(torch.tensor([ids])).logits[0, 0])
    seen = {}
    for _ in range(20):
        answer = httpx.post(f"{server.url}/v1/rewards", json={"text": [text]}, timeout=60)
        assert answer.status_code == 200, answer.text
        seen[answer.headers["x-rlserve-replica"]] = answer.json()["outputs"][0]["reward"]
    assert len(seen) == 2
    assert all(abs(reward - expected) <= 1e-5 for reward in seen.values()), seen


def test_an_episode_survives_its_replica_being_killed(
    server: Server, cluster: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rlserve_client import Client

    with Client(base_url=server.url, max_retries=8) as client:
        env_id = client.create_env(kind="tokens").env_id  # its requests stick to one replica
        client.reset_env(env_id, tokens=[[5, 6]])
        for step in range(2):
            client.step_env(env_id, actions=[{"tokens": [7 + step]}])
        state = client.get_env(env_id)
        assert state.rows[0].turns == 2
        victim = kill_a_replica(server, cluster, monkeypatch, session=env_id)
        for step in range(2, 5):  # served by the survivor while Ray starts a replacement
            result = client.step_env(env_id, actions=[{"tokens": [7 + step]}])
        assert result.outputs[0].observation.prompt_tokens == [5, 6, 7, 8, 9, 10, 11]
        assert client.get_env(env_id).rows[0].turns == 5
    seen = wait_for_replicas(server.url, 2)
    assert victim not in seen  # the killed replica was replaced by a new one


def kill_a_replica(
    server: Server, cluster: str, monkeypatch: pytest.MonkeyPatch, session: str | None = None
) -> str:
    """Kill the replica that answers next, or the one `session` sticks to (Ray starts
    another); its id."""
    victim = replica_of(server, session)
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    ray.init(address=cluster, namespace="serve", log_to_driver=False)
    try:
        names = [
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if victim in a["name"]
        ]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    finally:
        ray.shutdown()
    return victim


def replica_of(server: Server, session: str | None = None) -> str:
    headers = {SESSION_HEADER: session} if session else {}
    return httpx.get(f"{server.url}/ready", headers=headers, timeout=30).headers[
        "x-rlserve-replica"
    ]


def test_a_session_sticks_to_one_replica(server: Server) -> None:
    """`--sticky-sessions`: the requests of one session (its `x-session-id`) all reach one
    replica, and sessions spread over both."""
    homes = {}
    for session in [f"episode-{i}" for i in range(16)]:
        seen = {replica_of(server, session) for _ in range(5)}
        assert len(seen) == 1, (session, seen)
        homes[session] = seen.pop()
    assert len(set(homes.values())) == 2


def test_a_loaded_replica_lets_its_sessions_go_to_the_other(server: Server) -> None:
    """Load-gated affinity: while a session's replica holds `--affinity-threshold` requests
    (generations held by a pause), the session's next requests go to the other replica; once
    they are answered, the session goes back to its own."""
    session = "agent-7"
    home = replica_of(server, session)
    paused = httpx.post(f"{server.url}/v1/pause", json={"mode": "keep"}, timeout=60)
    assert paused.status_code == 200, paused.text
    body = {"tokens": [[1, 2, 3]], "max_tokens": 2, "temperature": 0}
    headers = {SESSION_HEADER: session}
    with ThreadPoolExecutor(AFFINITY_THRESHOLD + 1) as pool:
        try:
            held = []
            for _ in range(AFFINITY_THRESHOLD + 1):
                url = f"{server.url}/v1/generate"
                held.append(pool.submit(httpx.post, url, json=body, headers=headers, timeout=120))
                wait_for_held(server.url, len(held))
                # Ray counts a replica's requests in flight a moment after their answers
                # reach the client: the polls above must leave the count before the next
                # request is routed, or they push the owner past the threshold early.
                time.sleep(1)
            away = {replica_of(server, session) for _ in range(4)}
        finally:
            resumed = httpx.post(f"{server.url}/v1/resume", timeout=60)
        assert resumed.status_code == 200, resumed.text
        answers = [future.result() for future in held]
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    # The first `threshold` went home; the next found it loaded and went to the other.
    served_by = [a.headers["x-rlserve-replica"] for a in answers]
    assert served_by[:AFFINITY_THRESHOLD] == [home] * AFFINITY_THRESHOLD, (home, served_by)
    assert served_by[-1] != home, (home, served_by)
    assert away == {served_by[-1]}, (home, away)
    assert {replica_of(server, session) for _ in range(4)} == {home}


def wait_for_held(url: str, count: int, timeout: float = 30) -> None:
    """Until `count` generations wait for the resume, over all replicas."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = versions_by_replica(url, "/v1/serving")
        if sum(s["waiting"] for s in states.values()) >= count:  # type: ignore[index]
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {count} requests held: {states}")


def versions_by_replica(url: str, path: str = "/v1/weights/version") -> dict[str, object]:
    """What each replica answers to GET `path` (requests until both replicas answered)."""
    answers: dict[str, object] = {}
    for _ in range(60):
        response = httpx.get(f"{url}{path}", timeout=30)
        answers[response.headers["x-rlserve-replica"]] = response.json()
        if len(answers) == 2:
            break
    assert len(answers) == 2, answers
    return answers


def scores_by_replica(url: str, tokens: list[int]) -> dict[str, list[float]]:
    scores: dict[str, list[float]] = {}
    for _ in range(60):
        response = httpx.post(f"{url}/v1/logprobs", json={"tokens": [tokens]}, timeout=30)
        scores[response.headers["x-rlserve-replica"]] = response.json()["outputs"][0]["log_probs"][
            "full"
        ]
        if len(scores) == 2:
            break
    return scores


def test_a_weight_update_reaches_every_replica_or_none(server: Server, model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One load through the proxy: both replicas serve the new weights under one version. When
    one replica cannot take it (its data directory is broken), neither does, and the refusal
    says so; an upload reaches both the same way."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_close, forward_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = {k: v * 0.7 for k, v in model.state_dict().items() if k != "lm_head.weight"}
    checkpoint = tmp_path / "new.safetensors"
    save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint))
    before = {r: v["policy_version"] for r, v in versions_by_replica(server.url).items()}  # type: ignore[index]
    assert len(set(before.values())) == 1
    old = next(iter(before.values()))

    data_dir = Path(server.log).parent / "data"
    victim = next(iter(before))
    broken = data_dir / victim / "uploads"
    shutil.rmtree(broken, ignore_errors=True)
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("not a directory")
    refused = httpx.post(
        f"{server.url}/v1/weights/load", json={"path": str(checkpoint)}, timeout=120
    )
    assert refused.status_code >= 400, refused.text
    assert "1 of 2 replicas refused it" in refused.json()["error"]["message"]
    after = {r: v["policy_version"] for r, v in versions_by_replica(server.url).items()}  # type: ignore[index]
    assert set(after.values()) == {old}
    broken.unlink()

    loaded = httpx.post(
        f"{server.url}/v1/weights/load", json={"path": str(checkpoint)}, timeout=120
    )
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["policy_version"] == old + 1
    after = {r: v["policy_version"] for r, v in versions_by_replica(server.url).items()}  # type: ignore[index]
    assert set(after.values()) == {old + 1}
    tokens = [72, 105, 33, 10, 40, 50]
    model.load_state_dict(state, strict=False)
    expected = forward_log_probs(model, tokens)
    for replica_scores in scores_by_replica(server.url, tokens).values():
        assert_close(replica_scores, expected, 1e-4)

    uploaded = httpx.put(f"{server.url}/v1/weights", content=checkpoint.read_bytes(), timeout=120)
    assert uploaded.status_code == 200, uploaded.text
    after = {r: v["policy_version"] for r, v in versions_by_replica(server.url).items()}  # type: ignore[index]
    assert set(after.values()) == {old + 2}


def test_pause_and_resume_reach_every_replica(server: Server) -> None:
    paused = httpx.post(f"{server.url}/v1/pause", json={"mode": "wait"}, timeout=60)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    states = versions_by_replica(server.url, "/v1/serving")
    assert all(s["paused"] for s in states.values()), states  # type: ignore[index]
    resumed = httpx.post(f"{server.url}/v1/resume", timeout=60)
    assert resumed.status_code == 200 and resumed.json()["paused"] is False
    states = versions_by_replica(server.url, "/v1/serving")
    assert not any(s["paused"] for s in states.values()), states  # type: ignore[index]


def test_updates_in_parallel_apply_one_after_the_other_and_a_new_replica_catches_up(  # type: ignore[no-untyped-def]
    server: Server, cluster: str, model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two loads sent at once, a whole model and a partial one (layer 0 only), both apply,
    one after the other, every replica ending on the same weights; a pause is in force. A
    replica Ray starts after that (the old one killed) serves the same weights (both updates,
    in their order) under the same version, paused like the other, before it takes traffic."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_close, forward_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    base = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    updates = {
        "whole": {k: v * 0.5 for k, v in base.items()},
        "layer0": {k: v * 0.6 for k, v in base.items() if ".layers.0." in k},
    }
    for name, state in updates.items():
        save_file(
            {k: v.contiguous() for k, v in state.items()}, str(tmp_path / f"{name}.safetensors")
        )
    old = next(iter(versions_by_replica(server.url).values()))["policy_version"]  # type: ignore[index]

    def load(name: str) -> httpx.Response:
        body = {"path": str(tmp_path / f"{name}.safetensors")}
        return httpx.post(f"{server.url}/v1/weights/load", json=body, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        answers = dict(zip(updates, pool.map(load, updates), strict=True))
    assert {a.status_code for a in answers.values()} == {200}, [a.text for a in answers.values()]
    order = sorted(updates, key=lambda name: answers[name].json()["policy_version"])
    assert [answers[name].json()["policy_version"] for name in order] == [old + 1, old + 2]
    for name in order:  # the weights every replica must serve: both updates, in that order
        model.load_state_dict(updates[name], strict=False)
    tokens = [72, 105, 33, 10, 40, 50]
    expected = forward_log_probs(model, tokens)
    for replica_scores in scores_by_replica(server.url, tokens).values():
        assert_close(replica_scores, expected, 1e-4)

    paused = httpx.post(f"{server.url}/v1/pause", json={"mode": "keep"}, timeout=60)
    assert paused.status_code == 200
    try:
        victim = kill_a_replica(server, cluster, monkeypatch)
        seen = wait_for_replicas(server.url, 2)
        assert victim not in seen
        versions = versions_by_replica(server.url)
        assert {v["policy_version"] for v in versions.values()} == {old + 2}, versions  # type: ignore[index]
        states = versions_by_replica(server.url, "/v1/serving")
        assert all(s["paused"] for s in states.values()), states  # type: ignore[index]
    finally:
        resumed = httpx.post(f"{server.url}/v1/resume", timeout=60)
        assert resumed.status_code == 200
    for replica_scores in scores_by_replica(server.url, tokens).values():
        assert_close(replica_scores, expected, 1e-4)


def test_a_collective_transfer_reaches_every_replica_or_none(  # type: ignore[no-untyped-def]
    server: Server, cluster: str, model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's one broadcast reaches both replicas (each joined the group at its own
    rank): both serve the sent weights under one version. A send one replica refuses (a NaN)
    leaves both on the old version. A replica Ray starts afterwards catches up to the
    transferred weights; it is not in the group, which the state says and a send refuses,
    until the trainer joins again."""
    import copy

    import torch
    from rlserve_client import Client, ConflictError, UnprocessableEntityError
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_close, forward_log_probs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = [72, 105, 33, 10, 40, 50]

    def sent(scale: float) -> dict[str, torch.Tensor]:
        return {k: v * scale for k, v in model.state_dict().items() if k != "lm_head.weight"}

    def served_everywhere(version: int, weights: dict[str, torch.Tensor]) -> None:
        versions = versions_by_replica(server.url)
        assert {v["policy_version"] for v in versions.values()} == {version}, versions  # type: ignore[index]
        expected_model = copy.deepcopy(model)
        expected_model.load_state_dict(weights, strict=False)
        expected = forward_log_probs(expected_model, tokens)
        scores = scores_by_replica(server.url, tokens)
        assert len(scores) == 2
        for replica_scores in scores.values():
            assert_close(replica_scores, expected, 1e-4)

    with Client(base_url=server.url, max_retries=0, timeout=300) as client:
        state = client.transfer_state()
        assert (state.replicas, state.server_ranks, state.state) == (2, 2, "idle")
        old = client.weights_version().policy_version
        update = sent(0.9)
        with client.weight_transfer(master_address="127.0.0.1", timeout_s=120) as sync:
            joined = client.transfer_state()
            assert (joined.state, joined.world_size, joined.replicas) == ("joined", 3, 2)
            assert sync.send(update).policy_version == old + 1
            served_everywhere(old + 1, update)

            poisoned = sent(0.8)
            next(iter(poisoned.values()))[0] = float("nan")
            with pytest.raises(UnprocessableEntityError, match="NaN") as refused:
                sync.send(poisoned)
            assert "2 of 2 replicas refused it" in str(refused.value)
            served_everywhere(old + 1, update)

            victim = kill_a_replica(server, cluster, monkeypatch)
            assert victim not in wait_for_replicas(server.url, 2)
            served_everywhere(old + 1, update)  # the new replica caught up from the ledger
            split = client.transfer_state()
            assert split.state == "idle" and "1 idle, 1 joined" in (split.last_error or "")
            with pytest.raises(ConflictError, match="init"):
                sync.send(sent(0.7))
            served_everywhere(old + 1, update)

        again = sent(0.6)
        with client.weight_transfer(master_address="127.0.0.1", timeout_s=120) as sync:
            assert sync.send(again).policy_version == old + 2
        served_everywhere(old + 2, again)
        assert client.transfer_state().state == "idle"


def test_an_adapter_reaches_every_replica_and_a_new_replica_catches_up(  # type: ignore[no-untyped-def]
    server: Server, cluster: str, model_dir, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A LoRA adapter loaded through the proxy is served by both replicas at one version, and
    each push of new tensors (an upload, then the collective transfer) is its next version on
    both. A replica Ray starts after that serves the last version too, caught up from the
    ledger's record (its chunks Ray objects the ledger's actor owns). Unloaded, it is gone
    from both."""
    from peft import get_peft_model_state_dict
    from rlserve_client import Client
    from safetensors.torch import save

    from tests.adapters.models import peft_model
    from tests.conftest import assert_close, forward_log_probs

    options = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    first, second, third = (peft_model(model_dir, seed, **options) for seed in (1, 2, 3))
    first.save_pretrained(tmp_path / "a", save_embedding_layers=False)
    tokens = [72, 105, 33, 10, 40, 50]

    def served_everywhere(version: int, expected_model: Any) -> None:
        expected = forward_log_probs(expected_model, tokens)
        answers: dict[str, dict[str, Any]] = {}
        for _ in range(60):
            body = {"model": "ray-a", "tokens": [tokens]}
            response = httpx.post(f"{server.url}/v1/logprobs", json=body, timeout=60)
            assert response.status_code == 200, response.text
            answers[response.headers["x-rlserve-replica"]] = response.json()
            if len(answers) == 2:
                break
        assert len(answers) == 2
        for answer in answers.values():
            assert answer["policy_version"] == version  # (an adapter's answers carry its own)
            assert_close(answer["outputs"][0]["log_probs"]["full"], expected, 1e-4)

    # the adapters adapt the starting weights (the tests above changed the policy's)
    restored = httpx.post(f"{server.url}/v1/weights/restore", json={}, timeout=300)
    assert restored.status_code == 200, restored.text
    loaded = httpx.post(
        f"{server.url}/v1/adapters",
        json={"name": "ray-a", "path": str(tmp_path / "a")},
        timeout=300,
    )
    assert loaded.status_code == 200, loaded.text
    served_everywhere(0, first)
    pushed = httpx.put(
        f"{server.url}/v1/adapters/ray-a",
        content=save(get_peft_model_state_dict(second)),
        timeout=300,
    )
    assert pushed.status_code == 200 and pushed.json()["version"] == 1, pushed.text
    served_everywhere(1, second)
    # over the collective transfer: each replica receives the tensors at its own rank
    with Client(base_url=server.url, max_retries=0, timeout=300) as client:  # noqa: SIM117
        with client.weight_transfer(master_address="127.0.0.1", timeout_s=120) as sync:
            sent = sync.send_adapter(third, "ray-a")
    assert (sent.adapter, sent.adapter_version) == ("ray-a", 2)
    served_everywhere(2, third)

    victim = kill_a_replica(server, cluster, monkeypatch)
    assert victim not in wait_for_replicas(server.url, 2)
    served_everywhere(2, third)

    unloaded = httpx.delete(f"{server.url}/v1/adapters/ray-a", timeout=300)
    assert unloaded.status_code == 200, unloaded.text
    for _ in range(10):
        gone = httpx.post(
            f"{server.url}/v1/logprobs", json={"model": "ray-a", "tokens": [tokens]}, timeout=60
        )
        assert gone.status_code == 404 and "'ray-a' does not exist" in gone.text, gone.text


class _Proxy:
    """The proxy's address, as the dialect trainers of tests/weights reach a server."""

    def __init__(self, url: str) -> None:
        self.url = url

    def trainer_client(self) -> Any:
        from rlserve_client import Client

        return Client(base_url=self.url, max_retries=0, timeout=300)


def test_an_sglang_session_spans_the_replicas_its_calls_reach(  # type: ignore[no-untyped-def]
    server: Server, model_dir, tmp_path
) -> None:
    """An SGLang-speaking trainer's update through the proxy, each call reaching either
    replica: SGLang's begin, buckets and end, then slime's pause, buckets and continue. Both
    replicas join its group and receive every bucket; neither serves them before the session
    ends, and then both serve the trainer's weights under the version it named (the session is
    the ledger's record, not one replica's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.conftest import assert_close, forward_log_probs
    from tests.weights.conftest import perturbed
    from tests.weights.test_dialect_transfer import sglang_trainer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = [72, 105, 33, 10, 40, 50]
    for flow, scale in (("session", 1.1), ("paused", 1.2)):
        before = {v["policy_version"] for v in versions_by_replica(server.url).values()}  # type: ignore[index]
        (current,) = before
        new = perturbed(model, scale)
        seen = sglang_trainer(_Proxy(server.url), new, flow, current + 3, tmp_path)  # type: ignore[arg-type]
        assert seen == [current, current], "a bucket became visible before the update's end"
        versions = versions_by_replica(server.url)
        assert {v["policy_version"] for v in versions.values()} == {current + 3}, versions  # type: ignore[index]
        expected = forward_log_probs(new, tokens)
        for replica_scores in scores_by_replica(server.url, tokens).values():
            assert_close(replica_scores, expected, 1e-4)


def test_the_reward_models_weights_reach_every_replica(server: Server, settings) -> None:  # type: ignore[no-untyped-def]
    """The reward model's weights go through the one weights control: a push over HTTP (the
    pusher's whole push, then a delta of it) and a collective transfer each reach both
    replicas as one version, whose rewards are the pushed model's own forward on each."""
    import torch
    from rlserve_client import Client
    from rlserve_client.weight_push import WeightPusher
    from transformers import AutoModelForSequenceClassification

    from app.engine.loader import builtin_reward_dir

    path = builtin_reward_dir(settings.models)
    trainer = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    tokens = [5, 9, 13, 77, 101]

    def step(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            head = trainer.get_parameter("score.weight")
            head.add_(0.1 * torch.randn(head.shape, generator=generator))

    def served_everywhere(version: int) -> None:
        with torch.inference_mode():
            expected = float(trainer(torch.tensor([tokens])).logits[0, 0])
        seen: dict[str, dict[str, Any]] = {}
        for _ in range(60):
            answer = httpx.post(f"{server.url}/v1/rewards", json={"tokens": [tokens]}, timeout=60)
            assert answer.status_code == 200, answer.text
            seen[answer.headers["x-rlserve-replica"]] = answer.json()
            if len(seen) == 2:
                break
        assert len(seen) == 2
        for body in seen.values():
            assert body["reward_version"] == version
            assert abs(body["outputs"][0]["reward"] - expected) <= 1e-5, (body, expected)

    with Client(base_url=server.url, max_retries=0, timeout=300) as client:
        pusher = WeightPusher(client, model="reward")
        step(1)
        whole = pusher.push(trainer.state_dict())
        version = whole.updated.version
        assert version is not None
        assert not whole.delta and whole.digest_ok is True
        served_everywhere(version)
        step(2)
        delta = pusher.push(trainer.state_dict())
        assert delta.delta and delta.digest_ok is True and delta.updated.version == version + 1
        served_everywhere(version + 1)

        step(3)
        with client.weight_transfer(
            model="reward", master_address="127.0.0.1", timeout_s=120
        ) as sync:
            sent = sync.send(trainer.state_dict())
        assert (sent.model, sent.version) == ("reward", version + 2)
        served_everywhere(version + 2)
