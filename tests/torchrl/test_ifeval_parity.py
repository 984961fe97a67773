"""The ifeval reward against TorchRL's own IfEvalScorer (its instruction checks, its scoring of
the first <answer> block, its default aggregator) on every bundled row and many responses."""

from __future__ import annotations

import pytest

from tests.torchrl import torchrl_only

pytestmark = torchrl_only

# A response meant to follow each bundled row's instructions, in the rows' order.
FOLLOWING = [
    "A white tower guides ships home at night",
    "Light from the sun scatters in the air. Any other questions?",
    "hello neighbour, my grey cat is lost. please call me if you see her.",
    "* Start with one ball\n* Practise every day\n* Stay relaxed",
    '{"wheels": 2, "colour": "red"}',
    "<<River Song>>\nWater runs down to the sea.",
    "Bread is old.\n***\nBread is good.",
    "Chess has rules. Pawns move forward. Knights jump. Bishops slide. Kings matter. Mate ends it.",
    "GO TEAM GO, WE ARE THE BEST TEAM IN THE WHOLE WIDE WORLD",
    '"Eggs and toast with a pot of tea."',
    "Dear Sam, the trip was great.\nP.S. I miss you.",
    "Come to [address] at [time].",
    "Plants use *light energy* to make *sugar from air*.",
    "My answer is yes.",
    "Tea is warm and calm. A warm pot waits.",
    "A dog.******A cat.",
]


def responses(following: str) -> list[str]:
    return [
        f"<answer>{following}</answer>",
        f"<think>plan it</think><answer>{following}</answer>",
        f"<answer>{following}</answer> and <answer>more</answer>",  # two answers: no bonus
        f"Sure:\n<answer>Here you go:\n{following}\nThanks</answer>",  # loose drops lines
        f"<answer>**{following}**</answer>",  # loose removes asterisks
        following,  # no answer block: TorchRL checks ""
        "<answer>Short, plain, with commas, and Mixed Case.</answer>",
        "<think>a</think><think>b</think><answer></answer>",
    ]


def torchrl_score(scorer, fields, prompt, response):  # type: ignore[no-untyped-def]
    """IfEvalScorer._step's work for one row: the first answer block through its checks, then
    its default aggregator (the rest of _step is TensorDict plumbing for a ChatEnv)."""
    import re

    from tensordict import TensorDict
    from torchrl.envs.llm.reward.ifeval._scorer import _process_results

    data = TensorDict(batch_size=[])
    data.set("key", 0)
    data.set_non_tensor("instruction_id_list", list(fields["instruction_id_list"]))
    data.set_non_tensor("kwargs", [dict(k) for k in fields["kwargs"]])
    data.set_non_tensor("text", prompt)
    think_blocks = re.findall(r"<think>(.*?)</think>", response, re.DOTALL)
    answer_blocks = re.findall(r"<answer>(.*?)</answer>", response, re.DOTALL)
    score = _process_results(data, answer_blocks[0] if answer_blocks else "", prompt=prompt)
    reward = scorer.default_reward_aggregator(
        score, think_blocks=think_blocks, answer_blocks=answer_blocks
    )
    return score, float(reward.reshape(-1)[0]), bool(answer_blocks)


def test_ifeval_reward_equals_torchrl_ifeval_scorer_on_the_bundled_rows():
    from torchrl.envs.llm.reward.ifeval import IfEvalScorer

    from app.datasets.bundled import ifeval_problems
    from app.envs import ifeval
    from app.envs.rewards import Sample, score_reward

    assert ifeval.unavailable() is None  # also puts the Punkt model where both checks find it
    scorer = IfEvalScorer()
    problems = ifeval_problems()
    assert len(problems) == len(FOLLOWING)
    compared = followed = 0
    for problem, following in zip(problems, FOLLOWING, strict=True):
        for response in responses(following):
            theirs, reward, ends = torchrl_score(scorer, problem.fields, problem.query, response)
            ours = score_reward(
                "ifeval", {}, Sample(response, prompt=problem.query, fields=problem.fields)
            )
            where = (problem.query, response)
            for name in ("inst_level_strict_acc", "inst_level_loose_acc"):
                assert ours.info[name] == getattr(theirs, name).reshape(-1).tolist(), where
            for name in ("prompt_level_strict_acc", "prompt_level_loose_acc"):
                assert ours.info[name] == bool(getattr(theirs, name).reshape(-1)[0]), where
            assert ours.reward == pytest.approx(reward, abs=1e-6), where
            assert ours.ends_episode == ends, where  # TorchRL's set_done_if_answer
            compared += 1
            followed += ours.info["prompt_level_strict_acc"]
    assert compared == 8 * len(FOLLOWING)
    assert followed >= 2 * len(FOLLOWING)  # the following responses do follow: both kinds seen


def test_weights_set_as_in_torchrl():
    from torchrl.envs.llm.reward.ifeval import IfEvalScorer

    from app.datasets.bundled import ifeval_problems
    from app.envs.rewards import Sample, score_reward

    weights = [0.1, 0.2, 0.3, 0.4]
    scorer = IfEvalScorer(format_weights=weights)
    problem = ifeval_problems()[1]
    response = "<answer>Light scatters. **Any other questions?**</answer>"
    _, reward, _ = torchrl_score(scorer, problem.fields, problem.query, response)
    options = {"format_weights": weights}
    ours = score_reward("ifeval", options, Sample(response, fields=problem.fields))
    assert ours.reward == pytest.approx(reward, abs=1e-6)
