from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification

from app.config import Settings
from app.engine.loader import builtin_reward_dir
from tests.conftest import served_app


@pytest.fixture(scope="session")
def reward_dir(settings: Settings) -> Path:
    return builtin_reward_dir(settings.models)


@pytest.fixture(scope="session")
def reward_model(reward_dir: Path) -> torch.nn.Module:
    """An independent copy of the reward model, loaded the plain transformers way."""
    model = AutoModelForSequenceClassification.from_pretrained(reward_dir, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
async def rewarded(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """A server with the built-in reward model beside the policy (contexts of 300 tokens)."""
    with_reward = settings.replace(
        models={
            "reward_model": "builtin:tiny-reward",
            "load_reference": False,
            "max_model_len": 300,
        },
        storage={"data_dir": settings.storage.data_dir / "rewards"},
        batching={"timeout_s": 0.05, "max_batch_size": 16},
    )
    async with served_app(with_reward) as client:
        yield client


@torch.inference_mode()
def forward_reward(model: torch.nn.Module, ids: list[int]) -> float:
    """The model's own forward of one unpadded sequence: its pooled logit."""
    return float(model(torch.tensor([ids])).logits[0, 0])
