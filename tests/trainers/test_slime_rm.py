"""slime's remote reward model call (`slime.rollout.rm_hub`: `batched_async_rm` ->
`async_rm` -> `remote_rm`, `--rm-type remote_rm --rm-url URL`) from its own source against a
real rlserve serving a reward model beside the policy. slime is on no package registry: this
runs where `SLIME_SOURCE` names a checkout of THUDM/slime (checked at `624b824a`,
with `aiohttp` and `pylatexenc`, what its `rm_hub` imports), and skips elsewhere, CI included
(`tests/rewards/test_trainer_shapes.py` replays the same bodies there)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.config import Settings
from app.engine.loader import builtin_reward_dir
from tests.trainers.conftest import served_beside

pytestmark = pytest.mark.trainers
SOURCE = os.environ.get("SLIME_SOURCE")
if not SOURCE:
    pytest.skip("SLIME_SOURCE names no slime checkout", allow_module_level=True)
sys.path.insert(0, SOURCE)
rm_hub = pytest.importorskip("slime.rollout.rm_hub", reason="slime's rm_hub does not import")
from slime.utils.types import Sample  # noqa: E402


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("reward-cache")
    return builtin_reward_dir(Settings(models={"cache_dir": cache}).models)


@torch.inference_mode()
def forward_reward(path: Path, ids: list[int]) -> float:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    return float(model(torch.tensor([ids])).logits[0, 0])


def test_slimes_remote_rm_scores_a_group_with_the_served_reward_model(
    tmp_path: Path, reward_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(reward_path)
    prompt = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"
    responses = ["Blue.<|im_end|>", "Green, like grass.<|im_end|>", "Seven.<|im_end|>"]
    samples = [Sample(prompt=prompt, response=r, label="blue") for r in responses]
    chat = [{"role": "user", "content": "Name a colour."}]
    samples.append(Sample(prompt=chat, response="Red.", label=None))
    with served_beside(tmp_path, RLSERVE_MODELS__REWARD_MODEL=str(reward_path)) as server:
        args = SimpleNamespace(
            rm_type="remote_rm", rm_url=f"{server.url}/slime/reward", custom_rm_path=None
        )
        keyed = SimpleNamespace(**{**vars(args), "rm_url": f"{args.rm_url}?reward_key=score"})

        async def both() -> tuple[list[float], list[dict[str, float]]]:
            try:
                return (
                    await rm_hub.batched_async_rm(args, samples),
                    await rm_hub.batched_async_rm(keyed, samples),
                )
            finally:  # (its module-wide session, on this loop)
                await rm_hub._get_shared_session().close()

        plain, by_key = asyncio.run(both())
    expected = [
        forward_reward(reward_path, tokenizer(prompt + r, add_special_tokens=False)["input_ids"])
        for r in responses
    ]
    conversation = [*chat, {"role": "assistant", "content": "Red."}]
    expected.append(
        forward_reward(
            reward_path,
            tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False),
        )
    )
    assert len(plain) == len(samples) and len(set(plain)) == len(plain)
    for reward, want, keyed_reward in zip(plain, expected, by_key, strict=True):
        assert abs(reward - want) <= 1e-5
        assert keyed_reward == {"score": reward}
