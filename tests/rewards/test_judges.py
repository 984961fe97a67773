"""Judges: `reward: "judge:NAME"` in environments and rollouts. Each verdict is checked against
the judge model's own forward of the rubric (plain transformers, greedy), and a judge that
gives no score leaves the row's reward null with the reason and the judge's text."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
import torch
from pydantic import ValidationError

from app.config import Settings
from app.config_groups import JudgeSettings, ModelSettings
from app.engine.loader import builtin_model_dir
from app.rewards.judges import read_score, read_scores
from tests.conftest import served_app

DIGITS = [str(d) for d in range(10)]
RUBRIC = "Grade the reply.\nQuestion: {prompt}\nReply: {response}\nGrade:"
GROUP_RUBRIC = "Rank these {n} replies to: {prompt}\n\n{responses}\n\nScores:"
JUDGES = {
    "digits": {"model": "policy", "rubric": RUBRIC, "choices": DIGITS, "scale": [0, 9]},
    "free": {"model": "policy", "rubric": RUBRIC, "max_tokens": 6},
    "ranker": {"model": "policy", "mode": "group", "rubric": GROUP_RUBRIC, "max_tokens": 6},
    "elsewhere": {"model": "reference"},
    "cramped": {"model": "policy", "rubric": RUBRIC, "max_tokens": 8000},
    "third": {"model": "judge", "rubric": RUBRIC, "choices": DIGITS, "scale": [0, 9]},
}


@pytest.fixture(scope="module")
async def judged(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """The built-in policy serving as its own judge, and a third model (the built-in model
    of another seed, the `ref_model` fixture's) as 'judge'."""
    other = builtin_model_dir(settings.replace(models={"builtin_seed": 1}).models)
    with_judges = settings.replace(
        models={"load_reference": False, "judge_model": str(other)},
        rewards={"judges": JUDGES},
        storage={"data_dir": settings.storage.data_dir / "judges"},
    )
    async with served_app(with_judges) as client:
        yield client


def judge_ids(hf_tokenizer, content: str) -> list[int]:  # type: ignore[no-untyped-def]
    messages = [{"role": "user", "content": content}]
    ids = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@torch.inference_mode()
def greedy_text(model: torch.nn.Module, tokenizer, ids: list[int], n: int) -> str:  # type: ignore[no-untyped-def]
    """The model's own greedy continuation of `ids`, `n` tokens (or to its end of text)."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([ids + out])).logits[0, -1]
        token = int(logits.argmax())
        if token == tokenizer.eos_token_id:
            break
        out.append(token)
    return str(tokenizer.decode(out, skip_special_tokens=True))


async def chat_env(client: httpx.AsyncClient, reward: str, **config: object) -> str:
    created = await client.post("/v1/envs", json={"reward": reward, **config})
    assert created.status_code == 201, created.text
    return str(created.json()["env_id"])


@pytest.mark.parametrize("judge", ["digits", "third"])
async def test_a_judge_with_choices_answers_the_digit_its_model_ranks_highest(
    judged: httpx.AsyncClient,
    hf_model: torch.nn.Module,
    ref_model: torch.nn.Module,
    hf_tokenizer,  # type: ignore[no-untyped-def]
    judge: str,
) -> None:
    model = hf_model if judge == "digits" else ref_model
    env = await chat_env(judged, f"judge:{judge}", batch_size=3)
    queries = ["What is 2+3?", "Name a colour.", "Say hi."]
    await judged.post(f"/v1/envs/{env}/reset", json={"query": queries})
    replies = ["It is 5.", "Blue.", "Hello there!"]
    step = await judged.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": r} for r in replies]}
    )
    assert step.status_code == 200, step.text
    digit_ids = [hf_tokenizer.encode(d, add_special_tokens=False)[0] for d in DIGITS]
    for output, query, reply in zip(step.json()["outputs"], queries, replies, strict=True):
        ids = judge_ids(hf_tokenizer, RUBRIC.format(prompt=query, response=reply))
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, -1]
        digit = int(logits[digit_ids].argmax())
        breakdown = output["info"]["reward"]
        assert breakdown["judge"] == judge
        assert breakdown["judge_text"] == str(digit)
        assert breakdown["judge_score"] == digit
        assert output["reward"] == pytest.approx(digit / 9)
    state = (await judged.get(f"/v1/envs/{env}")).json()
    assert [row["total_reward"] for row in state["rows"]] == [
        o["reward"] for o in step.json()["outputs"]
    ]


async def test_a_judge_answer_without_a_score_is_a_null_reward_with_its_text(
    judged: httpx.AsyncClient, hf_model: torch.nn.Module, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    env = await chat_env(judged, "judge:free", batch_size=2)
    queries = ["What is 2+3?", "Name a colour."]
    await judged.post(f"/v1/envs/{env}/reset", json={"query": queries})
    replies = ["It is 5.", "Blue."]
    step = await judged.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": r} for r in replies]}
    )
    assert step.status_code == 200, step.text
    outputs = step.json()["outputs"]
    for output, query, reply in zip(outputs, queries, replies, strict=True):
        ids = judge_ids(hf_tokenizer, RUBRIC.format(prompt=query, response=reply))
        text = greedy_text(hf_model, hf_tokenizer, ids, 6)
        breakdown = output["info"]["reward"]
        assert breakdown["judge_text"] == text
        expected = read_score(JudgeSettings.model_validate(JUDGES["free"]), text)
        assert output["reward"] == expected.reward
        assert breakdown.get("reward_error") == expected.reason
    state = (await judged.get(f"/v1/envs/{env}")).json()
    assert [row["total_reward"] for row in state["rows"]] == [o["reward"] for o in outputs]
    assert any(o["reward"] is None for o in outputs), "the tiny judge gave every row a score"


async def test_a_group_judge_reads_the_answers_of_one_prompt_together(
    judged: httpx.AsyncClient, hf_model: torch.nn.Module, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    env = await chat_env(judged, "judge:ranker", batch_size=4, repeats=2)
    queries = ["What is 2+3?", "What is 2+3?", "Name a colour.", "Name a colour."]
    await judged.post(f"/v1/envs/{env}/reset", json={"query": queries})
    replies = ["5", "6", "Blue.", "Loud."]
    step = await judged.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": r} for r in replies]}
    )
    assert step.status_code == 200, step.text
    outputs = step.json()["outputs"]
    settings = JudgeSettings.model_validate(JUDGES["ranker"])
    for group in (0, 2):
        answers = "\n\n".join(f"Answer {k}:\n{replies[group + k - 1]}" for k in (1, 2))
        rubric = GROUP_RUBRIC.format(n=2, prompt=queries[group], responses=answers)
        text = greedy_text(hf_model, hf_tokenizer, judge_ids(hf_tokenizer, rubric), 6)
        verdicts = read_scores(settings, text, 2)
        for k in (0, 1):
            output = outputs[group + k]
            assert output["info"]["reward"]["judge_text"] == text
            assert output["reward"] == verdicts[k].reward
            assert output["info"]["reward"].get("reward_error") == verdicts[k].reason


async def test_rows_of_one_group_that_answer_different_prompts_are_judged_apart(
    judged: httpx.AsyncClient, hf_model: torch.nn.Module, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    env = await chat_env(judged, "judge:ranker", batch_size=2, repeats=2)
    queries = ["What is 2+3?", "Name a colour."]
    await judged.post(f"/v1/envs/{env}/reset", json={"query": queries})
    replies = ["5", "Blue."]
    step = await judged.post(
        f"/v1/envs/{env}/step", json={"actions": [{"text": r} for r in replies]}
    )
    assert step.status_code == 200, step.text
    for output, query, reply in zip(step.json()["outputs"], queries, replies, strict=True):
        rubric = GROUP_RUBRIC.format(n=1, prompt=query, responses=f"Answer 1:\n{reply}")
        text = greedy_text(hf_model, hf_tokenizer, judge_ids(hf_tokenizer, rubric), 6)
        assert output["info"]["reward"]["judge_text"] == text


async def test_the_judge_model_is_served_beside_the_policy(judged: httpx.AsyncClient) -> None:
    metrics = await judged.get("/metrics")
    assert metrics.status_code == 200, metrics.text
    body = {
        "model": "judge",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "batch_invariant": True,
    }
    chat = await judged.post("/v1/chat/completions", json=body)
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == "judge"


def test_no_alias_takes_a_served_models_name() -> None:
    for name in ("judge", "reward"):
        with pytest.raises(ValidationError, match="not one of"):
            ModelSettings(served_model_name=[name])


async def test_a_judge_that_cannot_answer_fails_its_rows_rewards_not_the_step(
    judged: httpx.AsyncClient,
) -> None:
    env = await chat_env(judged, "judge:cramped", batch_size=2)
    await judged.post(f"/v1/envs/{env}/reset", json={"query": ["Hi.", "Bye."]})
    step = await judged.post(f"/v1/envs/{env}/step", json={"actions": [{"text": "Yo."}] * 2})
    assert step.status_code == 200, step.text
    for output in step.json()["outputs"]:
        assert output["reward"] is None
        error = output["info"]["reward"]["reward_error"]
        assert "with its 8000 to answer it exceeds the judge model's context" in error
    assert (await judged.get("/ready")).status_code == 200


async def test_unknown_judges_and_judges_on_models_not_served_are_refused(
    judged: httpx.AsyncClient,
) -> None:
    models = (await judged.get("/v1/models")).json()["data"]
    assert {"policy", "judge"} <= {card["id"] for card in models}
    unknown = await judged.post("/v1/envs", json={"reward": "judge:nobody"})
    assert unknown.status_code == 422
    assert unknown.json()["error"]["param"] == "reward"
    assert "unknown judge 'nobody'" in unknown.json()["error"]["message"]
    elsewhere = await judged.post("/v1/envs", json={"reward": "judge:elsewhere"})
    assert elsewhere.status_code == 422
    assert "'reference', which is not served" in elsewhere.json()["error"]["message"]


def grpo_advantages(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5 if rewards[1:] else 0
    return [(r - mean) / max(std, 1e-6) for r in rewards]


@pytest.mark.parametrize("judge", ["digits", "free"])
async def test_judged_rollouts_leave_rows_without_a_score_out_of_their_group(
    judged: httpx.AsyncClient, judge: str
) -> None:
    env = {"reward": f"judge:{judge}", "batch_size": 8, "repeats": 8, "dataset": "arithmetic"}
    env["max_turns"] = 1
    body = {"env": env, "num_episodes": 8, "generation": {"max_new_tokens": 4, "seed": 3}}
    answer = await judged.post("/v1/rollouts", json=body)
    assert answer.status_code == 200, answer.text
    trajectories = answer.json()["trajectories"]
    scored = [t for t in trajectories if t["reward"] is not None]
    for trajectory in trajectories:
        step = trajectory["steps"][0]
        assert trajectory["reward"] == step["reward"]
        if trajectory["reward"] is None:
            assert trajectory.get("advantage") is None and step.get("advantage") is None
            assert step["info"]["reward"]["reward_error"]
    expected = grpo_advantages([t["reward"] for t in scored]) if scored else []
    assert [t["advantage"] for t in scored] == pytest.approx(expected)
    if judge == "digits":  # (a judge with choices always answers)
        assert len(scored) == 8


@pytest.mark.parametrize(
    ("text", "reward", "reason"),
    [
        ("Score: 7/10", 0.7, None),
        ("It is fine. 3 of 10 points... final score 8", 0.8, None),
        ("no number here", None, "the judge's answer has no score"),
        ("Score: 12", None, "the score 12 is outside the scale [0, 10]"),
        ("-0", 0.0, None),
    ],
)
def test_a_single_judges_answer_is_read_as_its_last_score(
    text: str, reward: float | None, reason: str | None
) -> None:
    verdict = read_score(JudgeSettings(), text)
    assert verdict.reward == (None if reward is None else pytest.approx(reward))
    assert verdict.reason == reason
    assert verdict.text == text


def test_a_group_judges_answer_scores_each_answer_by_its_number() -> None:
    judge = JudgeSettings(mode="group")
    text = "Answer 2: 4\nAnswer 1: 9\n3) 11\nAnswer 2: 5"
    verdicts = read_scores(judge, text, 4)
    assert [v.reward for v in verdicts[:2]] == [pytest.approx(0.9), pytest.approx(0.5)]
    assert verdicts[2].reason == "the score 11 is outside the scale [0, 10]"
    assert verdicts[3].reason == "the judge's answer scores no answer 4"


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"rubric": "Rate {reply}"}, "['reply'] not among"),
        ({"rubric": "Rate {prompt}"}, "names no {response}"),
        ({"mode": "group", "rubric": "Rate {response}"}, "['response'] not among"),
        ({"rubric": "Rate {response"}, "double literal braces"),
        ({"rubric": "Rate {response:d}"}, "rubric: cannot be filled in"),
        ({"rubric": "Rate {response[0]}"}, "['response[0]'] not among"),
        ({"pattern": "("}, "pattern: not a regular expression"),
        ({"pattern": "\\d+"}, "pattern: needs 1 capturing group"),
        ({"scale": [5, 5]}, "scale: 5.0 is not below 5.0"),
        ({"mode": "group", "choices": DIGITS}, "single mode only"),
        ({"choices": ["yes", "no"]}, "'yes' is not a score in the scale"),
        ({"choices": DIGITS, "scale": [1, 5]}, "'0' is not a score in the scale"),
        ({"scale": [0, "inf"]}, "is not finite"),
    ],
)
def test_a_judge_that_could_not_work_stops_the_start(fields: dict[str, object], words: str) -> None:
    with pytest.raises(ValidationError, match=words.replace("[", "\\[").replace("(", "\\(")):
        JudgeSettings.model_validate(fields)
