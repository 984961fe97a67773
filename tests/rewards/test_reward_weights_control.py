"""The reward model's weights change through the one weights control, as the policy's do: a
whole push, a delta, a collective transfer and a restore each serve the next version of the
reward model, whose rewards are then the pushed model's own forward, whose digest is the
trainer's, and which leaves the policy as it was. A judge model's weights load the same way."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from rlserve_client import AsyncClient, NotFoundError
from rlserve_client.weight_delta import weights_digest
from rlserve_client.weight_push import WeightPusher
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from app.config import Settings
from app.engine.loader import builtin_model_dir
from tests.conftest import assert_close, forward_log_probs, served_app
from tests.rewards.conftest import forward_reward
from tests.weights.conftest import loop_client

SEQUENCES = [[5, 9, 13, 77, 101], list(range(60, 120))]


@pytest.fixture(scope="module")
async def server(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A server of its own (its reward model's weights change), with a judge model."""
    other = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    config = settings.replace(
        models={
            "reward_model": "builtin:tiny-reward",
            "judge_model": str(other),
            "load_reference": False,
        },
        storage={"data_dir": settings.storage.data_dir / "reward-weights-control"},
    )
    async with served_app(config) as client:
        yield client


async def served_rewards(http: httpx.AsyncClient) -> tuple[int, list[float]]:
    answer = await http.post("/v1/rewards", json={"tokens": SEQUENCES})
    assert answer.status_code == 200, answer.text
    return answer.json()["reward_version"], [o["reward"] for o in answer.json()["outputs"]]


async def assert_serves(http: httpx.AsyncClient, version: int, model: torch.nn.Module) -> None:
    served, rewards = await served_rewards(http)
    assert served == version
    with torch.inference_mode():
        expected = [forward_reward(model, ids) for ids in SEQUENCES]
    assert rewards == pytest.approx(expected, abs=1e-5)


async def policy_scores(http: httpx.AsyncClient) -> list[list[float]]:
    answer = await http.post("/v1/logprobs", json={"tokens": SEQUENCES})
    assert answer.status_code == 200, answer.text
    return [o["log_probs"]["full"] for o in answer.json()["outputs"]]


def stepped(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """`model` after a sparse step: a few elements of its head and one layer moved."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in ("score.weight", "model.layers.0.mlp.down_proj.weight"):
            tensor = model.get_parameter(name)
            flat = tensor.view(-1)
            picked = torch.randperm(flat.numel(), generator=generator)[: max(1, flat.numel() // 50)]
            flat[picked] += 0.25
    return model


async def test_every_weights_path_serves_the_reward_models_next_version(
    server: httpx.AsyncClient, reward_model: torch.nn.Module
) -> None:
    app = server.app  # type: ignore[attr-defined]
    policy_before = await policy_scores(server)
    trainer = copy.deepcopy(reward_model)
    version, _ = await served_rewards(server)
    loop = asyncio.get_running_loop()
    with loop_client(app, loop) as sync_client:
        pusher = WeightPusher(sync_client, model="reward")
        whole = await asyncio.to_thread(pusher.push, trainer.state_dict())
        assert not whole.delta and whole.digest_ok is True
        version += 1
        await assert_serves(server, version, trainer)

        stepped(trainer, seed=1)
        delta = await asyncio.to_thread(pusher.push, trainer.state_dict())
        assert delta.delta and delta.digest_ok is True
        assert delta.sent_bytes < delta.full_bytes / 3
        version += 1
        await assert_serves(server, version, trainer)

    stepped(trainer, seed=2)
    state = {k: v.clone() for k, v in trainer.state_dict().items()}

    def transfer_from_thread() -> int:
        with (
            loop_client(app, loop) as sync_client,
            sync_client.weight_transfer(model="reward", master_address="127.0.0.1") as sync,
        ):
            sent = sync.send(state)
            assert sent.model == "reward"
            return int(sent.version)

    assert await asyncio.to_thread(transfer_from_thread) == version + 1
    version += 1
    await assert_serves(server, version, trainer)

    ready = (await server.get("/ready")).json()
    assert ready["digests"]["reward"] == weights_digest(trainer.state_dict())
    metrics = (await server.get("/metrics")).text
    assert f'model="reward",version="{version}"' in metrics

    restored = await server.post("/v1/weights/restore", json={"model": "reward"})
    assert restored.status_code == 200, restored.text
    assert restored.json()["version"] == version + 1
    await assert_serves(server, version + 1, reward_model)
    assert restored.json()["digest"] == weights_digest(reward_model.state_dict())

    assert await policy_scores(server) == policy_before
    assert (await server.get("/v1/weights/version")).json()["policy_version"] == 0


async def test_the_reward_route_and_the_weights_route_are_one_load(
    server: httpx.AsyncClient, reward_model: torch.nn.Module, tmp_path: Path
) -> None:
    """`POST /v1/rewards/weights` is `POST /v1/weights/load` for the reward model: they count
    one version sequence and refuse a version already served alike."""
    trainer = stepped(copy.deepcopy(reward_model), seed=3)
    save_file(
        {k: v.contiguous() for k, v in trainer.state_dict().items()}, tmp_path / "m.safetensors"
    )
    version, _ = await served_rewards(server)
    by_reward_route = await server.post("/v1/rewards/weights", json={"path": str(tmp_path)})
    assert by_reward_route.status_code == 200, by_reward_route.text
    assert by_reward_route.json()["reward_version"] == version + 1
    body = {"path": str(tmp_path), "model": "reward"}
    by_weights_route = await server.post("/v1/weights/load", json=body)
    assert by_weights_route.status_code == 200, by_weights_route.text
    assert by_weights_route.json()["version"] == version + 2
    await assert_serves(server, version + 2, trainer)
    for route, asked in (("/v1/rewards/weights", {}), ("/v1/weights/load", {"model": "reward"})):
        again = await server.post(
            route, json={"path": str(tmp_path), **asked, "version": version + 2}
        )
        assert again.status_code == 409, again.text
        assert again.json()["error"]["param"] == "version"
    await assert_serves(server, version + 2, trainer)


async def test_the_judge_models_weights_load_like_the_policys(
    server: httpx.AsyncClient, settings: Settings, tmp_path: Path
) -> None:
    judge_dir = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    judge = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        judge.get_parameter("model.norm.weight").mul_(0.5)
    save_file(
        {"model.norm.weight": judge.model.norm.weight.detach().clone()}, tmp_path / "j.safetensors"
    )
    loaded = await server.post("/v1/weights/load", json={"path": str(tmp_path), "model": "judge"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["version"] == 1 and loaded.json()["policy_version"] == 0
    answer = await server.post("/v1/logprobs", json={"tokens": SEQUENCES, "model": "judge"})
    assert answer.status_code == 200, answer.text
    for ids, output in zip(SEQUENCES, answer.json()["outputs"], strict=True):
        assert_close(output["log_probs"]["full"], forward_log_probs(judge, ids), 1e-5)


async def test_a_model_the_server_does_not_serve_is_404_on_the_weights_routes(
    settings: Settings, tmp_path: Path
) -> None:
    plain = settings.replace(
        models={"load_reference": False}, storage={"data_dir": tmp_path / "data"}
    )
    async with served_app(plain) as http:
        for model in ("reward", "judge", "reference"):
            refused = await http.post(
                "/v1/weights/load", json={"path": str(tmp_path), "model": model}
            )
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["param"] == "model"
        transport = httpx.ASGITransport(app=http.app)  # type: ignore[attr-defined]
        async with AsyncClient(base_url="http://rlserve", transport=transport) as client:
            with pytest.raises(NotFoundError):
                await client.load_reward_weights(path=str(tmp_path))
