"""The real TorchRL library beside the service, on the same built-in model: its wrappers,
reward parser and advantage transform must agree with what rlserve returns. Runs in
`.venv-torchrl` (scripts/test-torchrl.sh); skipped where torchrl is not installed."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.conftest import assert_close
from tests.torchrl import torchrl_only

pytestmark = torchrl_only

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 6*7?"},
        {"role": "assistant", "content": "42."},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, or green."},
    ],
]


async def post(client: httpx.AsyncClient, path: str, body: object) -> dict:  # type: ignore[type-arg]
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_log_probs_equal_torchrl_transformers_wrapper(client, hf_model, hf_tokenizer):
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm import TransformersWrapper

    wrapper = TransformersWrapper(
        hf_model, tokenizer=hf_tokenizer, input_mode="history", generate=False, pad_output=False
    )
    history = History.from_chats(CONVERSATIONS)
    td = wrapper(TensorDict({"history": {"full": history}}, batch_size=[2]))
    ours = await post(client, "/v1/logprobs", {"messages": CONVERSATIONS})
    for i, sample in enumerate(ours["outputs"]):
        row = td[i]
        assert sample["tokens"]["full"] == row["tokens", "full"].tolist()
        assert_close(sample["log_probs"]["full"], row["log_probs", "full"].tolist(), 2e-5)
        # Deliberate difference: TorchRL leaves the assistant's end-of-turn token out of the
        # mask; rlserve counts it (the policy wrote it, and must learn to stop).
        theirs_mask = row["masks", "all_assistant_mask"].int().tolist()
        ids = sample["tokens"]["full"]
        expected = [
            1 if m or (t == hf_tokenizer.eos_token_id and theirs_mask[i - 1]) else 0
            for i, (t, m) in enumerate(zip(ids, theirs_mask, strict=True))
        ]
        assert sum(expected) > sum(theirs_mask) > 0
        assert sample["masks"]["all_assistant_mask"] == expected


async def test_greedy_generation_equals_torchrl_transformers_wrapper(
    client, hf_model, hf_tokenizer, reference_log_probs
):
    from tensordict import TensorDict
    from torchrl.modules.llm import TransformersWrapper

    prompts = [[72, 101, 108, 108, 111], [50, 43, 50, 61]]
    wrapper = TransformersWrapper(
        hf_model,
        tokenizer=hf_tokenizer,
        input_mode="tokens",
        generate=True,
        pad_output=False,
        generate_kwargs={"max_new_tokens": 8, "do_sample": False},
    )
    td = TensorDict(
        {"tokens": {"prompt": torch.nested.as_nested_tensor([torch.tensor(p) for p in prompts])}},
        batch_size=[2],
    )
    theirs = wrapper(td)
    ours = await post(
        client,
        "/v1/generate",
        {"tokens": prompts, "max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    for i, (sample,) in enumerate(ours["outputs"]):
        row = theirs[i]
        response = row["tokens", "response"].tolist()
        assert sample["tokens"]["response"] == response
        mine, torchrl = sample["log_probs"]["response"], row["log_probs", "response"].tolist()
        assert_close(mine[1:], torchrl[1:], 2e-5)
        # Deliberate difference: TorchRL's generate path writes 0.0 for the first generated
        # token; rlserve returns its real log-prob (an independent forward agrees).
        assert torchrl[0] == 0.0
        full = prompts[i] + response
        assert mine[0] == pytest.approx(reference_log_probs(full)[len(prompts[i])], abs=2e-5)


RESPONSES = [
    ("<answer>42</answer>", "#### 42"),
    ("<think>6*7</think> <answer>42</answer>", "#### 42"),
    ("<answer>41</answer>", "#### 42"),
    ("no tag", "#### 42"),
    ("<answer></answer>", "#### 42"),
    ("<answer>3</answer><answer>4</answer>", "#### 4"),
    ("<answer>1,000.00</answer>", "#### 1,000"),
    ("<answer>50%</answer>", "#### 50"),
    ("<think> </think><answer>7.</answer>", "#### 7"),
]


@pytest.mark.parametrize(("response", "answer"), RESPONSES)
def test_gsm8k_reward_equals_torchrl_gsm8k_reward_parser(response, answer):
    from torchrl.envs.llm.reward.gsm8k import GSM8KRewardParser

    from app.envs.rewards import Sample, score_reward

    parser = GSM8KRewardParser()
    think, given = parser.extract_tags(response)
    theirs = parser._single_correctness_reward(answer.split("#### ")[1], given, think)
    ours = score_reward("gsm8k", {}, Sample(response, answer))
    assert ours.reward == pytest.approx(float(theirs["reward"]))
    assert ours.info["answer_given"] == bool(theirs["reward_answer"])
    assert ours.info["think"] == bool(theirs["reward_think"])
    assert ours.info["success"] == bool(theirs["success"])
    assert ours.ends_episode == bool(theirs["reward_answer"])  # TorchRL's set_done_if_answer


@pytest.mark.parametrize(("response", "answer"), RESPONSES[:4])
def test_gsm8k_reward_values_are_set_as_in_torchrl(response, answer):
    from torchrl.envs.llm.reward.gsm8k import GSM8KRewardParser

    from app.envs.rewards import Sample, score_reward

    parser = GSM8KRewardParser(format_reward=0.25, correct_reward=2.0)
    think, given = parser.extract_tags(response)
    theirs = parser._single_correctness_reward(answer.split("#### ")[1], given, think)
    options = {"format_reward": 0.25, "correct_reward": 2.0, "set_done_if_answer": False}
    ours = score_reward("gsm8k", options, Sample(response, answer))
    assert ours.reward == pytest.approx(float(theirs["reward"]))
    assert ours.info["right"] == pytest.approx(float(theirs["reward_right"]))
    assert ours.ends_episode is False  # as GSM8KRewardParser(set_done_if_answer=False)


def test_the_documented_normalisation_difference():
    """TorchRL keeps the space left after removing "$": its parser marks "$ 12" wrong."""
    from torchrl.envs.llm.reward.gsm8k import GSM8KRewardParser

    from app.envs.rewards import normalize_number

    assert GSM8KRewardParser.normalize_answer("$ 12") != "12"
    assert normalize_number("$ 12") == "12"


@pytest.mark.parametrize("how", ["steps", "sum", "mean", "max"])
async def test_rollout_advantages_equal_torchrl_mc_advantage(client, how):
    from tensordict import TensorDict
    from torchrl.objectives.llm import MCAdvantage

    from app.envs.rewards import REWARDS, RewardResult, Sample, register_reward

    @register_reward("byte_parity")
    def byte_parity(sample: Sample) -> RewardResult:
        return RewardResult(float(sum(sample.response.encode()) % 3))

    try:
        env = {
            "dataset": "arithmetic",
            "reward": "byte_parity",
            "batch_size": 4,
            "repeats": 4,
            "max_turns": 3,
        }
        out = await post(
            client,
            "/v1/rollouts",
            {
                "env": env,
                "num_episodes": 8,
                "generation": {"max_new_tokens": 4, "seed": 9},
                "trajectory_return": how,
            },
        )
    finally:
        REWARDS.pop("byte_parity")
    transform = MCAdvantage(
        grpo_size=4, prompt_key="group", trajectory_return=None if how == "steps" else how
    )
    num_groups = 0
    for trajectory in out["trajectories"]:
        steps = trajectory["steps"]
        num_steps = len(steps)
        td = TensorDict(
            {
                "group": torch.full((num_steps,), trajectory["group"]),
                "next": {
                    "reward": torch.tensor([[s["reward"]] for s in steps], dtype=torch.float64),
                    "done": torch.tensor([[s["done"]] for s in steps]),
                },
            },
            batch_size=[num_steps],
        )
        written = transform.inv(td)
        if written is None:
            continue
        advantages = written["advantage"].reshape(-1).tolist()
        group = [t for t in out["trajectories"] if t["group"] == trajectory["group"]]
        ours = [s["advantage"] for t in group for s in t["steps"]]
        assert_close(ours, advantages, 1e-6)
        num_groups += 1
    assert num_groups == 2
