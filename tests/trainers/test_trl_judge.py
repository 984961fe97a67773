"""TRL 1.0's `OpenAIPairwiseJudge` (trl.experimental.judges, from its PyPI release, unmodified;
TRL removed its judges after 1.0) against a real rlserve serving a judge model beside the
policy (`--judge-model`, named 'judge'): TRL's own OpenAI client posts its rubric to
`/v1/chat/completions` with `max_tokens: 1` and reads exactly "0" or "1" (anything else: -1).

The judge model is the built-in tiny model with an output head that can only say "0" or "1"
(every other token's logit is 0): "0" is `v`, "1" is `-v`, with `v` the difference of the last
hidden states of two pairs' prompts, scaled up. So the judge prefers one answer for one pair
and the other for the other pair, and each rank is checked against the head's own forward of
the prompt as TRL words it and the judge's tokenizer templates it (runs in .venv-trainers,
scripts/test-trainers.sh)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.config import Settings
from app.engine.loader import builtin_model_dir
from tests.trainers.conftest import served_beside

pytestmark = pytest.mark.trainers
judges = pytest.importorskip("trl.experimental.judges.judges", reason="TRL 1.0 is not installed")

PROMPTS = ["What is 6 times 7?", "Name a colour of the sky."]
COMPLETIONS = [["42", "67"], ["Green, always.", "Blue, on a clear day."]]


def judge_ids(tokenizer, prompt: str, pair: list[str]) -> list[int]:  # type: ignore[no-untyped-def]
    """The tokens rlserve's chat route reads for TRL's request about one pair."""
    content = judges.DEFAULT_PAIRWISE_SYSTEM_PROMPT.format(
        prompt=prompt, response0=pair[0], response1=pair[1]
    )
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@pytest.fixture(scope="module")
def judge_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a head that says "0" for the first pair and "1" for the second."""
    cache = tmp_path_factory.mktemp("judge-cache")
    source = builtin_model_dir(Settings(models={"cache_dir": cache}).models)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    with torch.inference_mode():
        last = [
            model.model(torch.tensor([judge_ids(tokenizer, p, c)])).last_hidden_state[0, -1]
            for p, c in zip(PROMPTS, COMPLETIONS, strict=True)
        ]
    direction = (last[0] - last[1]) * 100.0
    zero, one = (tokenizer.encode(d, add_special_tokens=False)[0] for d in "01")
    head = torch.zeros_like(model.lm_head.weight)
    head[zero], head[one] = direction, -direction
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(head.shape[1], head.shape[0], bias=False)
    model.lm_head.weight.data = head
    path = tmp_path_factory.mktemp("judge-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, judge_path: Path):  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp("trl-judge")
    with served_beside(tmp, RLSERVE_MODELS__JUDGE_MODEL=str(judge_path)) as running:
        yield running


@torch.inference_mode()
def expected_rank(path: Path, prompt: str, pair: list[str]) -> int:
    """The judge model's own greedy answer, read as TRL reads it."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    logits = model(torch.tensor([judge_ids(tokenizer, prompt, pair)])).logits[0, -1]
    answer = tokenizer.decode([int(logits.argmax())])
    return int(answer) if answer in ("0", "1") else -1


def test_trls_pairwise_judge_ranks_with_the_served_judge_model(
    server, judge_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("OPENAI_BASE_URL", f"{server.url}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    judge = judges.OpenAIPairwiseJudge(model="judge")
    ranks = judge.judge(PROMPTS, COMPLETIONS, shuffle_order=False)
    expected = [expected_rank(judge_path, p, c) for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    assert expected == [0, 1]  # (the head was built so; each pair gets the other answer)
    assert ranks == expected
    # The same pairs the other way round: each rank again the judge model's own answer.
    flipped = judge.judge(PROMPTS, [pair[::-1] for pair in COMPLETIONS], shuffle_order=False)
    pairs = zip(PROMPTS, COMPLETIONS, strict=True)
    assert flipped == [expected_rank(judge_path, p, c[::-1]) for p, c in pairs]
