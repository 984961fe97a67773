"""A generation frozen across a weight change: every token is labelled with the weights that
produced it, and after the change the cache is rebuilt, so the later tokens' log-probs are
exactly the new model's on the whole sequence."""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

from app.engine.transformers import decode as hf_decode
from app.engine.transformers.freeze import ModelThreadControl
from app.engine.types import GenerateItem, SamplingConfig, VersionSpan
from tests.conftest import assert_close, forward_log_probs

PROMPT = (5, 17, 33, 2, 90)
NEW_TOKENS = 24
FREEZE_AFTER_CALLS = 7  # the prefill and six decode steps: seven tokens on the old weights


class Tripwire:
    """The model, stopping at its k-th forward until the test lets it go on."""

    def __init__(self, model: Any, k: int) -> None:
        self.model, self.k, self.calls = model, k, 0
        self.device = model.device
        self.forward = model.forward  # whose signature names the cache argument
        self.reached, self.proceed = threading.Event(), threading.Event()

    def __call__(self, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.k:
            self.reached.set()
            self.proceed.wait(30)
        return self.model(**kwargs)


def test_tokens_after_a_frozen_update_come_from_the_new_weights(hf_model):
    model = copy.deepcopy(hf_model)
    old = copy.deepcopy(hf_model)
    control = ModelThreadControl()
    wire = Tripwire(model, FREEZE_AFTER_CALLS)
    config = SamplingConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    item = GenerateItem(PROMPT, config, seed=3)
    results: list[Any] = []

    def run() -> None:
        with control.running():  # as the backend runs every call on its model thread
            results.extend(
                hf_decode.generate(
                    wire, [item], pad_id=0, eos_ids=frozenset(), decode=str, control=control
                )
            )

    decode = threading.Thread(target=run)
    decode.start()
    assert wire.reached.wait(30)
    swap_while_parked(control, model, wire.proceed)
    decode.join(30)

    (generation,) = results
    assert generation.finish_reason == "length"
    assert_old_then_new(generation, PROMPT, old, model, FREEZE_AFTER_CALLS, NEW_TOKENS)


def swap_while_parked(
    control: ModelThreadControl, model: torch.nn.Module, proceed: threading.Event
) -> None:
    """With the decode loop held (until `proceed`) short of its next checkpoint: a freeze,
    which waits for the loop to park there, then new weights (the old ones times 1.25) as
    version 1, and the thaw."""
    quiet: list[bool] = []
    froze = threading.Thread(target=lambda: quiet.append(control.freeze(30)))
    froze.start()
    while not control.frozen:
        pass
    assert not control.freeze(0.05), "frozen while the loop still runs"
    proceed.set()
    froze.join(30)
    assert quiet == [True], "the decode loop never parked"
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(1.25)
    control.version = 1
    control.thaw()


def assert_old_then_new(
    generation: Any,
    prompt: tuple[int, ...],
    old: torch.nn.Module,
    new: torch.nn.Module,
    k: int,
    new_tokens: int,
) -> None:
    """`new_tokens` tokens, the first `k` labelled and scored as the `old` weights', the rest
    as the `new` ones' over the whole sequence (and measurably not as the old ones')."""
    tokens = generation.token_ids
    assert len(tokens) == new_tokens
    assert generation.versions == [VersionSpan(0, 0, k), VersionSpan(1, k, new_tokens)]
    full, start = list(prompt) + tokens, len(prompt)
    assert_close(generation.log_probs[:k], forward_log_probs(old, full)[start : start + k], 1e-5)
    assert_close(generation.log_probs[k:], forward_log_probs(new, full)[start + k :], 1e-4)
    on_old = forward_log_probs(old, full)[start + k :]
    assert max(abs(a - b) for a, b in zip(generation.log_probs[k:], on_old, strict=True)) > 1e-3


def test_an_abort_ends_rows_with_what_they_have(hf_model):
    control = ModelThreadControl()
    wire = Tripwire(hf_model, 4)
    config = SamplingConfig(max_new_tokens=50, ignore_eos=True)
    results: list[Any] = []
    decode = threading.Thread(
        target=lambda: results.extend(
            hf_decode.generate(
                wire,
                [GenerateItem(PROMPT, config, seed=1), GenerateItem(PROMPT[:2], config, seed=2)],
                pad_id=0,
                eos_ids=frozenset(),
                decode=str,
                control=control,
            )
        )
    )
    decode.start()
    assert wire.reached.wait(30)
    control.aborting.set()
    wire.proceed.set()
    decode.join(30)
    for generation in results:
        assert generation.finish_reason == "abort"
        assert len(generation.token_ids) == 3  # tokens of the forwards before the abort
        assert generation.versions == [VersionSpan(0, 0, 3)]
