"""The trainers' own reward-model calls, from their PyPI releases, unmodified, against a real
rlserve serving a reward model beside the policy (runs in .venv-trainers,
scripts/test-trainers.sh):

- verl 0.9.1's reward loop (`RewardLoopWorker.compute_score_disrm`, its discriminative reward
  model over HTTP): the conversation and the decoded response templated with the reward model's
  tokenizer, posted to vLLM's `/classify` (`use_activation: false`, read as
  `data[-1].probs[-1]`) and to SGLang's `/v1/embeddings` (read as `data[-1].embedding[-1]`),
  the model named by its path;
- OpenRLHF 0.11.2's HTTP reward call (`SingleTurnAgentExecutor._fetch_rewards_via_http`, the
  URL its --reward.remote_url gives).

Each reward equals `AutoModelForSequenceClassification`'s forward of the tokens the reward
model's tokenizer gives the text."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from app.config import Settings
from app.engine.loader import builtin_reward_dir
from tests.trainers.conftest import served_beside

pytestmark = pytest.mark.trainers
reward_loop = pytest.importorskip(
    "verl.experimental.reward_loop.reward_loop", reason="verl is not installed"
)
agent = pytest.importorskip("openrlhf.utils.agent", reason="OpenRLHF is not installed")

from omegaconf import OmegaConf  # noqa: E402
from verl.protocol import DataProto  # noqa: E402

CHAT = [{"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def reward_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in reward model as a folder: what a trainer names by its path."""
    cache = tmp_path_factory.mktemp("reward-cache")
    return builtin_reward_dir(Settings(models={"cache_dir": cache}).models)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, reward_path: Path):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("reward-callers")
    with served_beside(tmp, RLSERVE_MODELS__REWARD_MODEL=str(reward_path)) as running:
        yield running


@torch.inference_mode()
def forward_reward(path: Path, text: str, *, special: bool) -> float:
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    return float(model(torch.tensor([ids])).logits[0, 0])


def policy_tokenizer(url: str):  # type: ignore[no-untyped-def]
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    return AutoTokenizer.from_pretrained(next(c["source"] for c in cards if c["id"] == "policy"))


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_verl_reward_loop_scores_with_the_served_reward_model(
    server, reward_path: Path, engine: str
) -> None:  # type: ignore[no-untyped-def]
    worker = reward_loop.RewardLoopWorker.__new__(reward_loop.RewardLoopWorker)
    worker.reward_router_address = server.url.removeprefix("http://")
    worker.input_tokenizer = policy_tokenizer(server.url)
    worker.reward_model_tokenizer = AutoTokenizer.from_pretrained(reward_path)
    worker.config = OmegaConf.create(
        {"reward": {"reward_model": {"model_path": str(reward_path), "rollout": {"name": engine}}}}
    )
    # one rollout: the prompt's tokens, then a response of 6 tokens padded to 8
    response = worker.input_tokenizer("42, since 6*7=42")["input_ids"][:6]
    prompt_len, pad = 5, worker.input_tokenizer.pad_token_id
    data = DataProto.from_dict(
        tensors={
            "responses": torch.tensor([[*response, pad, pad]]),
            "attention_mask": torch.tensor([[1] * prompt_len + [1] * 6 + [0, 0]]),
        },
        non_tensors={"raw_prompt": np.array([CHAT], dtype=object)},
    )
    scored = asyncio.run(worker.compute_score_disrm(data[-1:]))
    text = worker.reward_model_tokenizer.apply_chat_template(
        [*CHAT, {"role": "assistant", "content": worker.input_tokenizer.decode(response)}],
        add_generation_prompt=False,
        tokenize=False,
    )
    expected = forward_reward(reward_path, text, special=True)
    assert abs(scored["reward_score"] - expected) <= 1e-5


def test_openrlhf_http_reward_call_reads_the_served_rewards(server, reward_path: Path) -> None:  # type: ignore[no-untyped-def]
    executor = agent.SingleTurnAgentExecutor(remote_rm_url=f"{server.url}/get_reward")
    queries = [
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>",
    ]
    (answer,) = asyncio.run(executor._fetch_rewards_via_http(queries, ["2+2?", "2+2?"], ["4", "4"]))
    assert answer["scores"] == answer["rewards"] and answer["extra_logs"] == {}
    for reward, query in zip(answer["scores"], queries, strict=True):
        assert abs(reward - forward_reward(reward_path, query, special=False)) <= 1e-5
    assert answer["scores"][0] != answer["scores"][1]
