"""`POST /v1/rewards/weights`: the reward model's weights loaded from a checkpoint, as its next
version. Every later reward is the loaded model's own forward, and a checkpoint that does not
fit is refused before the model is touched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from rlserve_client import AsyncClient, ConflictError
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification

from app.config import Settings
from tests.conftest import served_app
from tests.rewards.conftest import forward_reward

SEQUENCES = [[5, 9, 13, 77, 101], list(range(60, 120))]


@pytest.fixture(scope="module")
async def loading(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A server of its own: these tests change its reward model."""
    with_reward = settings.replace(
        models={"reward_model": "builtin:tiny-reward", "load_reference": False},
        storage={"data_dir": settings.storage.data_dir / "reward-weights"},
    )
    async with served_app(with_reward) as client:
        yield client


def perturbed(reward_dir: Path, seed: int) -> dict[str, torch.Tensor]:
    """The head and one layer's MLP of the reward model, changed."""
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    names = ["score.weight", "model.layers.0.mlp.down_proj.weight"]
    return {
        name: state[name] + 0.05 * torch.randn(state[name].shape, generator=generator)
        for name in names
    }


def model_with(reward_dir: Path, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    model.load_state_dict(tensors, strict=False)
    return model.eval()


async def rewards(client: httpx.AsyncClient) -> tuple[int, list[float]]:
    answer = await client.post("/v1/rewards", json={"tokens": SEQUENCES})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    return body["reward_version"], [o["reward"] for o in body["outputs"]]


async def test_a_loaded_checkpoint_is_the_next_version_and_scores_as_its_own_forward(
    loading: httpx.AsyncClient, reward_dir: Path, tmp_path: Path
) -> None:
    tensors = perturbed(reward_dir, seed=1)
    save_file(tensors, tmp_path / "model.safetensors")
    loaded = await loading.post("/v1/rewards/weights", json={"path": str(tmp_path)})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["reward_version"] == 1
    assert loaded.json()["num_tensors"] == 2
    version, served = await rewards(loading)
    assert version == 1
    expected = model_with(reward_dir, tensors)
    for reward, ids in zip(served, SEQUENCES, strict=True):
        assert abs(reward - forward_reward(expected, ids)) <= 1e-5

    again = await loading.post("/v1/rewards/weights", json={"path": str(tmp_path), "version": 1})
    assert again.status_code == 409
    assert again.json()["error"]["param"] == "version"
    later = await loading.post("/v1/rewards/weights", json={"path": str(tmp_path), "version": 5})
    assert later.status_code == 200 and later.json()["reward_version"] == 5


@pytest.mark.parametrize(
    ("change", "status", "words"),
    [
        ("shape", 422, "has shape"),
        ("name", 422, "unknown parameter 'model.nothing'"),
        ("nan", 422, "holds NaN or infinite values"),
        ("missing", 404, "does not exist on the server"),
    ],
)
async def test_a_checkpoint_that_does_not_fit_leaves_the_reward_model_as_it_was(
    loading: httpx.AsyncClient,
    reward_dir: Path,
    tmp_path: Path,
    change: str,
    status: int,
    words: str,
) -> None:
    before = await rewards(loading)
    tensors = perturbed(reward_dir, seed=2)
    if change == "shape":
        tensors["score.weight"] = torch.zeros(2, tensors["score.weight"].shape[1])
    elif change == "name":
        tensors["model.nothing"] = torch.zeros(3)
    elif change == "nan":
        tensors["score.weight"][0, 0] = float("nan")
    path = tmp_path / "gone" if change == "missing" else tmp_path
    if change != "missing":
        save_file(tensors, tmp_path / "model.safetensors")
    refused = await loading.post("/v1/rewards/weights", json={"path": str(path)})
    assert refused.status_code == status, refused.text
    assert words in refused.json()["error"]["message"]
    assert await rewards(loading) == before


async def test_the_python_client_loads_and_reads_the_reward_model(
    loading: httpx.AsyncClient, reward_dir: Path, tmp_path: Path
) -> None:
    """`AsyncClient.load_reward_weights` and `AsyncClient.rewards`: a checkpoint, then a head
    alone (what a trainer refitting the head sends), each read back as its own forward."""
    transport = httpx.ASGITransport(app=loading.app)  # type: ignore[attr-defined]
    tensors = perturbed(reward_dir, seed=3)  # (every tensor the other tests load, replaced)
    save_file(tensors, tmp_path / "model.safetensors")
    head = {"score.weight": perturbed(reward_dir, seed=4)["score.weight"]}
    save_file(head, tmp_path / "head.safetensors")
    async with AsyncClient(base_url="http://rlserve", transport=transport) as client:
        before = (await client.rewards(tokens=SEQUENCES)).reward_version
        for number, (name, expected) in enumerate(
            [("model", tensors), ("head", {**tensors, **head})], start=1
        ):
            loaded = await client.load_reward_weights(path=str(tmp_path / f"{name}.safetensors"))
            assert loaded.reward_version == before + number
            assert loaded.num_tensors == (2 if name == "model" else 1)
            scored = await client.rewards(tokens=SEQUENCES, token_values=True)
            assert scored.reward_version == loaded.reward_version
            model = model_with(reward_dir, expected)
            for output, ids in zip(scored.outputs, SEQUENCES, strict=True):
                assert abs(output.reward - forward_reward(model, ids)) <= 1e-5
                assert output.num_tokens == len(ids) == len(output.token_values or [])
        with pytest.raises(ConflictError) as refused:
            await client.load_reward_weights(path=str(tmp_path), version=1)
    assert refused.value.param == "version"
