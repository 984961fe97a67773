"""The ifeval reward on hand-made responses: which instructions each follows is worked out by
hand here, and the reward from those results with TorchRL's formula written out in the test."""

from __future__ import annotations

import pytest

from app.common.failures import InvalidInput
from app.datasets.bundled import ifeval_problems
from app.envs import ifeval
from app.envs.rewards import Sample, first_bad_row, parse_options, score_reward

pytestmark = pytest.mark.skipif(
    ifeval.unavailable() is not None, reason=f"ifeval checks: {ifeval.unavailable()}"
)

SHORT_NO_COMMA = {
    "instruction_id_list": ["length_constraints:number_words", "punctuation:no_comma"],
    "kwargs": [{"num_words": 40, "relation": "less than"}, {}],
}
JSON = {"instruction_id_list": ["detectable_format:json_format"], "kwargs": [{}]}
SKY = {
    "instruction_id_list": ["keywords:existence", "startend:end_checker"],
    "kwargs": [{"keywords": ["light", "scatter"]}, {"end_phrase": "Any other questions?"}],
}
SENTENCES = {
    "instruction_id_list": ["length_constraints:number_sentences"],
    "kwargs": [{"num_sentences": 3, "relation": "at least"}],
}

FEWER_THAN_4 = {
    "instruction_id_list": ["length_constraints:number_sentences"],
    "kwargs": [{"num_sentences": 4, "relation": "less than"}],
}


def torchrl_reward(strict: list[bool], loose: list[bool], answers: int, thinks: int) -> float:
    """IfEvalScorer.default_reward_aggregator (TorchRL 0.14), written out."""
    accuracy = (
        0.4 * all(strict)
        + 0.3 * sum(strict) / len(strict)
        + 0.2 * all(loose)
        + 0.1 * sum(loose) / len(loose)
    )
    return accuracy + 0.1 * (answers == 1) + 0.05 * (thinks == 1)


CASES = [
    # both followed, one answer block
    (SHORT_NO_COMMA, "<answer>A tall white tower stands by the sea</answer>", [1, 1], [1, 1]),
    # a comma breaks one of two; the think block earns its bonus
    (SHORT_NO_COMMA, "<think>short</think><answer>Waves, rocks and light</answer>", [1, 0], [1, 0]),
    # 41 words is not fewer than 40
    (SHORT_NO_COMMA, "<answer>" + "word " * 41 + "</answer>", [0, 1], [0, 1]),
    # JSON inside a fenced block is JSON
    (JSON, '<answer>```json\n{"wheels": 2}\n```</answer>', [1], [1]),
    # a preamble line fails strict; loose drops the first line and passes
    (JSON, '<answer>Here it is:\n{"wheels": 2}</answer>', [0], [1]),
    # markdown asterisks around the end phrase: loose removes them
    (
        SKY,
        "<answer>Light from the sun scatters in the air. **Any other questions?**</answer>",
        [1, 0],
        [1, 1],
    ),
    (SENTENCES, "<answer>One. Two. Three.</answer>", [1], [1]),
    (SENTENCES, "<answer>One. Two.</answer>", [0], [0]),
    # Punkt knows "Dr." ends no sentence: 3 sentences, fewer than 4 (a split at every "." says 4)
    (FEWER_THAN_4, "<answer>Dr. Smith came. He left. Bye.</answer>", [1], [1]),
]


@pytest.mark.parametrize(("fields", "response", "strict", "loose"), CASES)
def test_hand_made_responses(fields, response, strict, loose):  # type: ignore[no-untyped-def]
    result = score_reward("ifeval", {}, Sample(response, prompt="a prompt", fields=fields))
    info = result.info
    assert info["inst_level_strict_acc"] == [bool(s) for s in strict]
    assert info["inst_level_loose_acc"] == [bool(s) for s in loose]
    assert info["prompt_level_strict_acc"] is all(strict)
    assert info["prompt_level_loose_acc"] is all(loose)
    thinks = response.count("<think>")
    expected = torchrl_reward([bool(s) for s in strict], [bool(s) for s in loose], 1, thinks)
    assert result.reward == pytest.approx(expected)
    assert result.ends_episode is True


def test_without_an_answer_block_every_instruction_fails_and_the_episode_goes_on():
    result = score_reward(
        "ifeval", {}, Sample("<think>hm</think>A tall white tower", fields=SHORT_NO_COMMA)
    )
    assert result.info["inst_level_loose_acc"] == [False, False]
    assert result.reward == pytest.approx(0.05)  # the think bonus alone
    assert result.ends_episode is False


def test_options_weights_bonuses_and_what_is_scored():
    both = "<answer>A tall white tower stands by the sea</answer>"
    options = {"format_weights": [1, 0, 0, 0], "answer_bonus": 0.5, "think_bonus": 0}
    assert score_reward("ifeval", options, Sample(both, fields=SHORT_NO_COMMA)).reward == 1.5
    whole = Sample('{"wheels": 2}', fields=JSON)
    assert score_reward("ifeval", {}, whole).reward == 0  # no answer block: "" is checked
    scored = score_reward("ifeval", {"scored": "response"}, whole)
    assert scored.reward == pytest.approx(1.0) and scored.ends_episode is False
    kept = {"set_done_if_answer": False}
    assert score_reward("ifeval", kept, Sample(both, fields=SHORT_NO_COMMA)).ends_episode is False
    with pytest.raises(InvalidInput) as bad:
        parse_options("ifeval", {"format_weights": [1, 2]})
    assert bad.value.param == "reward_options.format_weights"


def test_the_repeat_prompt_check_reads_the_prompt_it_is_given():
    fields = {
        "instruction_id_list": ["combination:repeat_prompt"],
        "kwargs": [{"prompt_to_repeat": "Name a colour."}],
    }
    good = Sample("<answer>Name a colour. Blue.</answer>", prompt="Name a colour.", fields=fields)
    bad = Sample("<answer>Blue.</answer>", prompt="Name a colour.", fields=fields)
    assert score_reward("ifeval", {}, good).info["inst_level_strict_acc"] == [True]
    assert score_reward("ifeval", {}, bad).info["inst_level_strict_acc"] == [False]


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({}, "instruction_id_list", "non-empty list"),
        ({"instruction_id_list": [], "kwargs": []}, "instruction_id_list", "non-empty"),
        ({"instruction_id_list": ["no:such"], "kwargs": [{}]}, "instruction_id_list[0]", "unknown"),
        ({"instruction_id_list": ["punctuation:no_comma"]}, "kwargs", "list of 1"),
        ({"instruction_id_list": ["keywords:existence"], "kwargs": [{}]}, "kwargs[0]", "needs"),
        (
            {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{"x": 1}]},
            "kwargs[0]",
            "not ['x']",
        ),
        (
            {
                "instruction_id_list": ["length_constraints:number_words"],
                "kwargs": [{"num_words": 5, "relation": "more than"}],
            },
            "kwargs[0]",
            "relation",
        ),
    ],
)
def test_rows_it_cannot_score_deterministically_are_refused(fields, field, words):  # type: ignore[no-untyped-def]
    problem = ifeval.check_fields(fields)
    assert problem is not None
    assert problem[0] == field and words in problem[1]


def test_every_bundled_row_can_be_scored():
    problems = ifeval_problems()
    assert len(problems) >= 16
    assert first_bad_row("ifeval", [p.fields for p in problems]) is None
    ids = {i for p in problems for i in p.fields["instruction_id_list"]}
    assert len(ids) >= 18  # most of IFEval's instruction kinds appear
