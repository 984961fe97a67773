"""A third-party harness that speaks OpenAI runs an evaluation against rlserve end to end:
lm-evaluation-harness's `local-chat-completions` model over a task written here (a local JSONL
dataset, no downloads). Its recorded replies are the ones rlserve gives the same requests."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.server import Server, serving_here

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is installed in the main venv only")
pytestmark = pytest.mark.slow

ROWS = [
    {"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6)]
]
UTILS = """
def process_results(doc, results):
    return {"correct": float(results[0].strip() == doc["answer"])}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, settings) -> Iterator[Server]:  # type: ignore[no-untyped-def]
    with serving_here(tmp_path_factory.mktemp("harness-e2e"), settings) as running:
        yield running


def write_task(directory: Path) -> None:
    data = directory / "arith.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (directory / "utils.py").write_text(UTILS)
    (directory / "rlserve_arith.yaml").write_text(
        textwrap.dedent(
            f"""\
            task: rlserve_arith
            dataset_path: json
            dataset_kwargs:
              data_files:
                test: {data}
            test_split: test
            output_type: generate_until
            doc_to_text: "{{{{question}}}}"
            doc_to_target: "{{{{answer}}}}"
            process_results: !function utils.process_results
            generation_kwargs:
              until: ["\\n"]
              max_gen_toks: 12
              do_sample: false
            metric_list:
              - metric: correct
                aggregation: mean
                higher_is_better: true
            """
        )
    )


def test_lm_eval_chat_completions_runs_a_task(server, tmp_path, monkeypatch):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from openai import OpenAI

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_task(tmp_path)
    model_args = (
        f"base_url={server.url}/v1/chat/completions,model=policy,num_concurrent=1,"
        "max_retries=1,tokenized_requests=False"
    )
    results = simple_evaluate(
        model="local-chat-completions",
        model_args=model_args,
        tasks=["rlserve_arith"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        apply_chat_template=True,
        log_samples=True,
    )
    assert results is not None
    metrics = results["results"]["rlserve_arith"]
    assert 0.0 <= metrics["correct,none"] <= 1.0
    samples = results["samples"]["rlserve_arith"]
    assert len(samples) == len(ROWS)
    with OpenAI(base_url=f"{server.url}/v1", api_key="-") as sdk:
        for sample in samples:
            reply = sdk.chat.completions.create(
                model="policy",
                messages=[{"role": "user", "content": sample["doc"]["question"]}],
                max_tokens=12,
                temperature=0,
                stop=["\n"],
                seed=1234,
            )
            assert sample["resps"][0][0] == reply.choices[0].message.content
