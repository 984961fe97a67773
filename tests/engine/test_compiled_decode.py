"""Compiled decoding over a static cache (`models.compile_decode`,
`app.engine.transformers.compiled`): the tokens eager decoding gives, log-probs within float32
rounding of a forward over the whole sequence, a keep-mode weight swap mid-generation, and a
model whose step does not compile decoding eagerly."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.engine.transformers import decode as hf_decode
from app.engine.transformers.compiled import GRAPH_LENGTH_STEP, CompiledDecode
from app.engine.transformers.freeze import ModelThreadControl
from app.engine.types import GenerateItem, SamplingConfig
from tests.conftest import assert_close, forward_log_probs, served_app
from tests.engine.test_freeze import assert_old_then_new, swap_while_parked

EOS = frozenset({0})


@pytest.fixture(scope="module")
def model(hf_model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the built-in model: the compiled call is kept on the model object."""
    return copy.deepcopy(hf_model)


def mixed_batch() -> list[GenerateItem]:
    """Prompts of several lengths, a group sharing a prompt, penalties, a stop id, a prompt's
    log-probs, min-tokens and greedy rows: six rows."""
    short, long = (5, 17, 33), tuple(range(40, 61))
    return [
        GenerateItem(short, SamplingConfig(max_new_tokens=20, temperature=0.8), seed=1),
        GenerateItem(short, SamplingConfig(max_new_tokens=20, temperature=0.8), seed=2),
        GenerateItem(
            long,
            SamplingConfig(max_new_tokens=28, repetition_penalty=1.3, presence_penalty=0.5),
            seed=3,
        ),
        GenerateItem((7,), SamplingConfig(max_new_tokens=12, do_sample=False), seed=4),
        GenerateItem(
            (9, 8, 7, 6),
            SamplingConfig(max_new_tokens=24, return_prompt_log_probs=True, min_tokens=4),
            seed=5,
        ),
        GenerateItem(long[:9], SamplingConfig(max_new_tokens=16, stop_token_ids=(3, 4)), seed=6),
    ]


def run(model: Any, items: list[GenerateItem], compiled: CompiledDecode | None) -> list[Any]:
    return hf_decode.generate(model, items, pad_id=0, eos_ids=EOS, decode=str, compiled=compiled)


@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "graph-shapes"])
def test_compiled_steps_give_eager_tokens_and_forward_log_probs(model, graphs):
    """`graph-shapes`: the batch padded to a power of two and the cache to a multiple of
    GRAPH_LENGTH_STEP, as under CUDA graphs (the graphs themselves need a CUDA device)."""
    items = mixed_batch()
    eager = run(model, items, None)
    compiled = CompiledDecode(model, graphs=graphs)
    for _ in range(2):  # the second call reuses the compiled step (and, shaped, the cache)
        generations = run(model, items, compiled)
        for item, got, want in zip(items, generations, eager, strict=True):
            assert got.token_ids == want.token_ids
            assert got.finish_reason == want.finish_reason
            full = list(item.prompt_ids) + got.token_ids
            scored = forward_log_probs(model, full)
            assert_close(got.log_probs, scored[len(item.prompt_ids) :], 1e-5)
            # The prompt's come from the eager prefill, as without compiling.
            assert got.prompt_log_probs == want.prompt_log_probs
    assert compiled.steps >= 2 * (max(it.config.max_new_tokens for it in items) - 1)
    if graphs:
        with torch.inference_mode():
            ids, nothing_prefilled = (
                torch.ones((6, 21), dtype=torch.long),
                SimpleNamespace(layers=[]),
            )
            shaped = compiled.begin(ids, torch.ones_like(ids), 28, nothing_prefilled)
        assert shaped.mask.shape == (8, GRAPH_LENGTH_STEP)


class Pausing:
    """A token sink that holds the decode loop at its `k`-th token until the test lets it go
    on (the loop parks at its next checkpoint, before the next step)."""

    def __init__(self, k: int) -> None:
        self.k, self.count = k, 0
        self.reached, self.proceed = threading.Event(), threading.Event()

    def put(self, token_ids: list[int], log_probs: list[float]) -> None:
        self.count += len(token_ids)
        if self.count == self.k:
            self.reached.set()
            self.proceed.wait(30)


def test_a_weight_swap_mid_generation_rebuilds_the_static_cache(hf_model):
    model, old = copy.deepcopy(hf_model), copy.deepcopy(hf_model)
    compiled = CompiledDecode(model)
    prompt, new_tokens, k = (5, 17, 33, 2, 90), 24, 7
    sink = Pausing(k)
    item = GenerateItem(
        prompt, SamplingConfig(max_new_tokens=new_tokens, ignore_eos=True), seed=3, sink=sink
    )
    control = ModelThreadControl()
    results: list[Any] = []

    def decode() -> None:
        with control.running():
            results.extend(
                hf_decode.generate(
                    model,
                    [item],
                    pad_id=0,
                    eos_ids=frozenset(),
                    decode=str,
                    control=control,
                    compiled=compiled,
                )
            )

    thread = threading.Thread(target=decode)
    thread.start()
    assert sink.reached.wait(120)
    swap_while_parked(control, model, sink.proceed)
    thread.join(120)

    (generation,) = results
    assert compiled.steps >= new_tokens - 2, "the steps did not run compiled"
    assert_old_then_new(generation, prompt, old, model, k, new_tokens)


def test_a_model_whose_step_does_not_compile_decodes_eagerly(model, monkeypatch):
    def refuses(fn: Any, **options: Any) -> Any:
        def call(**kwargs: Any) -> Any:
            raise RuntimeError("this forward does not compile")

        return call

    monkeypatch.setattr(torch, "compile", refuses)
    items = mixed_batch()
    eager = run(model, items, None)
    compiled = CompiledDecode(model)
    assert compiled.usable()
    first = run(model, items, compiled)  # its first step fails: the cache rebuilt, on eagerly
    assert [g.token_ids for g in first] == [g.token_ids for g in eager]
    for got, want in zip(first, eager, strict=True):
        assert_close(got.log_probs, want.log_probs, 1e-5)
    assert not compiled.usable() and compiled.steps == 0
    later = run(model, items, compiled)  # the eager path itself
    assert [g.log_probs for g in later] == [g.log_probs for g in eager]


async def test_the_server_decodes_compiled_where_set(settings):
    body = {"tokens": [[5, 17, 33], [40, 41, 42, 43, 44]], "max_new_tokens": 16, "seed": 7}
    outputs = {}
    for setting in (False, True):
        configured = settings.replace(models={"backend": "transformers", "compile_decode": setting})
        async with served_app(configured) as client:
            backend = client.app.state.registry.get("policy").backend  # type: ignore[attr-defined]
            assert (backend.compiled is not None) == setting
            warmed = backend.compiled.steps if setting else 0
            assert warmed == (4 if setting else 0)  # compiled at load: 2 steps alone, 2 of four
            response = await client.post("/v1/generate", json=body)
            assert response.status_code == 200, response.text
            outputs[setting] = response.json()["outputs"]
            if setting:
                assert backend.compiled.steps == warmed + 15
    for eager, compiled in zip(outputs[False], outputs[True], strict=True):
        assert eager[0]["tokens"] == compiled[0]["tokens"]
        assert_close(eager[0]["log_probs"]["response"], compiled[0]["log_probs"]["response"], 1e-5)
