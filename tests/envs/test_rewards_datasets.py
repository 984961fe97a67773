"""GSM8K reward (TorchRL GSM8KRewardParser rules) and the bundled dataset."""

from __future__ import annotations

import json

import pytest

from app.envs.datasets import DatasetRegistry, arithmetic_problems
from app.envs.rewards import REWARDS, ground_truth, gsm8k_reward, normalize_number, register_reward


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so <answer>42</answer>", "6*7 = 42\n#### 42", 1.0),
        ("<answer>41</answer>", "#### 42", 0.1),
        ("the answer is 42", "#### 42", 0.0),
        ("<answer>1,000.00</answer>", "#### 1000", 1.0),
        ("<answer>$1,000.</answer>", "#### 1000", 1.0),
        ("<answer>50%</answer>", "#### 50", 1.0),
        ("<answer> 7.50 </answer>", "#### 7.5", 1.0),
        ("<answer>3</answer> then <answer>4</answer>", "#### 4", 1.0),
    ],
)
def test_gsm8k_reward(response, answer, reward):
    result = gsm8k_reward(response, answer)
    assert result.reward == reward
    assert result.ends_episode == ("<answer>" in response)


def test_normalisation_rules():
    assert normalize_number("1,234.500") == "1234.5"
    assert normalize_number("$12.") == "12"
    assert normalize_number("10.0") == "10"
    assert normalize_number("100") == "100"  # integer zeros stay
    assert ground_truth("steps\n#### 1,000") == "1000"


def test_adding_a_reward_is_one_function():
    @register_reward("length")
    def length(response, answer):  # type: ignore[no-untyped-def]
        from app.envs.rewards import RewardResult

        return RewardResult(float(len(response)))

    try:
        assert REWARDS["length"]("abc", None).reward == 3.0
    finally:
        del REWARDS["length"]


def test_bundled_dataset_is_gsm8k_shaped_and_correct():
    problems = arithmetic_problems(64, seed=3)
    assert problems == arithmetic_problems(64, seed=3)
    for p in problems:
        numbers = [
            int(w) for w in p.query.replace(".", " ").replace("?", " ").split() if w.isdigit()
        ]
        start, bought, given = numbers
        assert ground_truth(p.answer) == str(start + bought - given)


def test_jsonl_datasets_are_registered_by_file_name(tmp_path):
    rows = [{"query": "1+1?", "answer": "#### 2"}, {"query": "2+2?", "answer": "#### 4"}]
    (tmp_path / "tiny.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    registry = DatasetRegistry(tmp_path)
    assert registry.names() == ["arithmetic", "tiny"]
    assert [p.answer for p in registry.get("tiny") or []] == ["#### 2", "#### 4"]
