"""GSM8K reward (TorchRL GSM8KRewardParser rules) and the bundled dataset."""

from __future__ import annotations

import json
import re

import pytest

from app.common.failures import InvalidInput
from app.datasets.bundled import BundledDatasets, arithmetic_problems, sum_problems
from app.envs.rewards import (
    REWARDS,
    RewardResult,
    Sample,
    ground_truth,
    normalize_number,
    parse_options,
    register_reward,
    score_reward,
)


@pytest.mark.parametrize(
    ("response", "answer", "reward", "ends"),
    [
        ("so <answer>42</answer>", "6*7 = 42\n#### 42", 1.0, True),
        ("<answer>41</answer>", "#### 42", 0.1, True),
        ("the answer is 42", "#### 42", 0.0, False),
        ("<answer>1,000.00</answer>", "#### 1000", 1.0, True),
        ("<answer>$1,000.</answer>", "#### 1000", 1.0, True),
        ("<answer>50%</answer>", "#### 50", 1.0, True),
        ("<answer> 7.50 </answer>", "#### 7.5", 1.0, True),
        # TorchRL scores the first tag; so do we by default
        ("<answer>3</answer> then <answer>4</answer>", "#### 4", 0.1, True),
        ("<answer>4</answer> then <answer>3</answer>", "#### 4", 1.0, True),
        # an empty tag is no answer: no format reward, the episode goes on
        ("<answer></answer>", "#### 4", 0.0, False),
        ("<answer>  </answer>", "#### 4", 0.0, False),
        # TorchRL keeps the space left after removing "$" and fails this one (its bug)
        ("<answer>$ 12</answer>", "#### 12", 1.0, True),
        ("<answer>12 %</answer>", "#### 12", 1.0, True),
    ],
)
def test_gsm8k_reward(response, answer, reward, ends):
    result = score_reward("gsm8k", {}, Sample(response, answer))
    assert result.reward == reward
    assert result.ends_episode is ends
    assert result.info["answer_given"] is ends
    assert result.info["success"] is (reward == 1.0)


def test_gsm8k_options_pick_the_last_tag_and_set_the_values():
    options = {"answer_tag": "last", "correct_reward": 2.0, "format_reward": 0.25}
    both = "<answer>3</answer> then <answer>4</answer>"
    assert score_reward("gsm8k", options, Sample(both, "#### 4")).reward == 2.0
    assert score_reward("gsm8k", options, Sample(both, "#### 3")).reward == 0.25
    thought = score_reward("gsm8k", {}, Sample("<think>hm</think><answer>4</answer>", "#### 4"))
    assert thought.info["think"] is True and thought.info["right"] == 1.0
    with pytest.raises(InvalidInput) as bad:
        parse_options("gsm8k", {"answer_tag": "middle"})
    assert bad.value.param == "reward_options.answer_tag"
    with pytest.raises(InvalidInput) as unknown:
        parse_options("none", {"x": 1})
    assert unknown.value.param == "reward_options.x"


def test_normalisation_rules():
    assert normalize_number("1,234.500") == "1234.5"
    assert normalize_number("$12.") == "12"
    assert normalize_number("$ 12") == "12"
    assert normalize_number("10.0") == "10"
    assert normalize_number("100") == "100"  # integer zeros stay
    assert ground_truth("steps\n#### 1,000") == "1000"


def test_adding_a_reward_is_one_function():
    @register_reward("length")
    def length(sample: Sample) -> RewardResult:
        return RewardResult(float(len(sample.response)))

    try:
        assert score_reward("length", {}, Sample("abc")).reward == 3.0
    finally:
        del REWARDS["length"]


def test_bundled_dataset_is_gsm8k_shaped_and_correct():
    """Every problem the server bundles (and those of other seeds) has a sensible answer:
    nobody gives away more than they have, so the count left is at least one."""
    assert arithmetic_problems(64, seed=3) == arithmetic_problems(64, seed=3)
    bundled = BundledDatasets(None).get("arithmetic")
    assert bundled is not None and len(bundled) == 256
    for p in [*bundled, *arithmetic_problems(512, seed=3)]:
        numbers = [
            int(w) for w in p.query.replace(".", " ").replace("?", " ").split() if w.isdigit()
        ]
        start, bought, given = numbers
        assert given < start + bought, p.query
        assert ground_truth(p.answer) == str(start + bought - given)


def test_the_sums_are_right_and_reproducible():
    problems = sum_problems(64, seed=5, largest=9)
    assert problems == sum_problems(64, seed=5, largest=9)
    assert len({p.query for p in problems}) > 20
    for p in problems:
        a, b = (int(x) for x in re.fullmatch(r"What is (\d) \+ (\d)\?", p.query).groups())
        assert ground_truth(p.answer) == str(a + b)
        assert score_reward("number", {}, Sample(f"{a} + {b} = {a + b}.", p.answer)).reward == 1


@pytest.mark.parametrize(
    ("response", "options", "reward", "given"),
    [
        ("7 + 5 = 12", {}, 1.0, "12"),
        ("The answer is 12.", {}, 1.0, "12"),
        ("12 is 7 + 5", {}, 0.0, "5"),
        ("12 is 7 + 5", {"which": "first"}, 1.0, "12"),
        ("It is 1,012.0 in all", {}, 0.0, "1012"),
        ("twelve", {}, 0.0, None),
        ("7 + 5 = 12", {"correct_reward": 2.5}, 2.5, "12"),
        ("-12", {}, 0.0, "-12"),
    ],
)
def test_number_reward_reads_the_number_the_reply_ends_on(response, options, reward, given):
    result = score_reward("number", options, Sample(response, "7 + 5 = 12\n#### 12"))
    assert result.reward == reward
    assert result.info["given"] == given and result.info["expected"] == "12"
    assert result.info["correct"] is (reward > 0) and not result.ends_episode


def test_jsonl_datasets_are_registered_by_file_name(tmp_path):
    rows = [{"query": "1+1?", "answer": "#### 2"}, {"query": "2+2?", "answer": "#### 4"}]
    (tmp_path / "tiny.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    registry = BundledDatasets(tmp_path)
    assert registry.names() == ["addition", "arithmetic", "ifeval", "tiny"]
    assert [p.answer for p in registry.get("tiny") or []] == ["#### 2", "#### 4"]
