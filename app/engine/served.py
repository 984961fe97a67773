"""A served model behind its request batchers, and the policy/reference pair used for KL."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from app.batching import BackendCallError, Batcher, BatchingConfig
from app.common.inputs import InputPreparer
from app.engine.adapter_gate import AdapterGate
from app.engine.base import Backend, Capabilities, ScoreItem
from app.engine.types import GenerateItem, Generation, Scores, ScoreSpec, version_spans
from app.weights.lora import LoraAdapter

logger = logging.getLogger(__name__)
R = TypeVar("R")
T = TypeVar("T")


class ServedModel:
    """A loaded backend, the input preparer for its tokenizer, and its request batchers."""

    def __init__(
        self,
        backend: Backend,
        preparer: InputPreparer,
        batching: BatchingConfig | None,
        *,
        invariant: bool = False,
    ) -> None:
        self.name = backend.info.name
        self.backend = backend
        self.preparer = preparer
        self.invariant = invariant
        """Batch-invariant by default: a call that does not say runs each row alone."""
        self.num_tokens_scored = 0
        self.num_tokens_generated = 0
        self.last_success = 0.0  # time.monotonic() of the last backend call that returned
        self.scoring: Batcher[Sequence[int], list[float]] | None = None
        self.generation: Batcher[GenerateItem, Generation] | None = None
        self.detailed: Batcher[ScoreItem, Scores] | None = None
        if batching is not None:
            scoring, detailed, generation = batching_policy(backend.capabilities, batching)
            self.scoring = Batcher(f"{self.name}/score", self._score_batch, len, scoring)
            self.detailed = Batcher(
                f"{self.name}/score-detailed", self._detailed_batch, _item_length, detailed
            )
            self.generation = Batcher(
                f"{self.name}/generate", self._generate_batch, _generation_length, generation
            )

    def _alone(self, alone: bool | None) -> bool:
        return self.invariant if alone is None else alone

    async def _score_batch(self, sequences: list[Sequence[int]]) -> list[list[float]]:
        scored = await self.backend.score(sequences)
        self.last_success = time.monotonic()
        return scored

    async def _detailed_batch(self, items: list[ScoreItem]) -> list[Scores]:
        scored = await self.backend.score_detailed(items)
        self.last_success = time.monotonic()
        return scored

    async def _generate_batch(self, items: list[GenerateItem]) -> list[Generation]:
        generations = await self.backend.generate(items)
        self.last_success = time.monotonic()
        return generations

    async def score(
        self, sequences: Sequence[Sequence[int]], *, alone: bool | None = None
    ) -> list[list[float]]:
        """`alone`: each sequence in a backend call of its own, never batched with another
        (batch-invariant mode; None: the model's default)."""
        if self._alone(alone):
            scored = await _one_at_a_time(self._score_batch, sequences)
        elif self.scoring is None:
            scored = await _direct(self._score_batch(list(sequences)))
        else:
            scored = await self.scoring.submit(sequences)
        self.num_tokens_scored += sum(len(s) for s in sequences)
        return scored

    async def score_detailed(
        self, items: Sequence[ScoreItem], *, alone: bool | None = None
    ) -> list[Scores]:
        """Raw log-probs and the extras each item's spec asks for."""
        if self._alone(alone):
            scored = await _one_at_a_time(self._detailed_batch, items)
        elif self.detailed is None:
            scored = await _direct(self._detailed_batch(list(items)))
        else:
            scored = await self.detailed.submit(items)
        self.num_tokens_scored += sum(len(seq) for seq, _ in items)
        return scored

    async def generate(
        self, items: Sequence[GenerateItem], *, alone: bool | None = None
    ) -> list[Generation]:
        if self._alone(alone):
            own = [dataclasses.replace(item, reuse_prefix=False) for item in items]
            generations = await _one_at_a_time(self._generate_batch, own)
        elif self.generation is None:
            generations = await _direct(self._generate_batch(list(items)))
        else:
            generations = await self.generation.submit(items)
        self.num_tokens_generated += sum(len(g.token_ids) for g in generations)
        return generations

    async def check(self, fresh_s: float) -> None:
        """Raise if the engine cannot serve. A call that returned, or a step of one still in
        flight, within `fresh_s` seconds is proof enough (a probe would wait behind a long
        batch and time out on an engine that works); otherwise the backend runs its probe."""
        alive = max(self.last_success, self.backend.stepped_at())
        if time.monotonic() - alive < fresh_s:
            return
        await self.backend.check()
        self.last_success = time.monotonic()

    async def aclose(self) -> None:
        for batcher in (self.scoring, self.detailed, self.generation):
            if batcher is not None:
                await batcher.aclose()
        await self.backend.aclose()
        self.preparer.close()


def batching_policy(
    capabilities: Capabilities, base: BatchingConfig
) -> tuple[BatchingConfig, BatchingConfig, BatchingConfig]:
    """(scoring, detailed scoring, generation) batching for an engine. By default all three
    group requests into calls. An engine that batches continuously gets every generation row
    and every plain scoring request straight away: it schedules them itself, under its own
    token budget per step, and a request held back to join a group would leave it idle.
    Detailed scoring, whose answers may hold the whole vocabulary at every position, groups
    two calls at a time within half the token budget, which bounds what they hold at once."""
    if not capabilities.continuous_batching:
        return base, base, base
    straight = dataclasses.replace(
        base, min_batch_size=1, max_batch_size=1, timeout_s=0.0, max_concurrent_calls=4096
    )
    detailed = dataclasses.replace(
        base, max_concurrent_calls=2, max_batch_tokens=max(base.max_batch_tokens // 2, 1)
    )
    return straight, detailed, straight


def _item_length(item: ScoreItem) -> int:
    return len(item[0])


def _generation_length(item: GenerateItem) -> int:
    return len(item.prompt_ids) + item.config.max_new_tokens


async def _one_at_a_time(
    call: Callable[[list[T]], Awaitable[list[R]]], items: Sequence[T]
) -> list[R]:
    """Each item in a backend call of its own, one after another (batch-invariant mode)."""
    return [(await _direct(call([item])))[0] for item in items]


async def _direct(call: Awaitable[R]) -> R:
    """Batching off: one backend call per request, errors reported like batched ones."""
    try:
        return await call
    except Exception as exc:
        logger.exception("backend call failed")
        raise BackendCallError(f"{type(exc).__name__}: {exc}") from exc


class AdaptedModel(ServedModel):
    """A LoRA adapter served as a model of its own: the rows it is asked for go to its base's
    batchers, named for the adapter, so they batch with the base's rows and other adapters'."""

    def __init__(self, base: ServedModel, adapter: LoraAdapter, gate: AdapterGate) -> None:
        # (No batchers of its own: every call goes through the base's.)
        self.name = adapter.name
        self.base = base
        self.adapter = adapter
        self.gate = gate
        """Admits the adapter's requests (its own pause: `ModelRegistry.generating`)."""
        self.backend = base.backend
        self.preparer = base.preparer
        self.invariant = base.invariant

    async def score(
        self, sequences: Sequence[Sequence[int]], *, alone: bool | None = None
    ) -> list[list[float]]:
        spec = ScoreSpec(adapter=self.adapter)
        scored = await self.base.score_detailed([(s, spec) for s in sequences], alone=alone)
        return [s.log_probs.tolist() for s in scored]

    async def score_detailed(
        self, items: Sequence[ScoreItem], *, alone: bool | None = None
    ) -> list[Scores]:
        adapted = [(seq, dataclasses.replace(spec, adapter=self.adapter)) for seq, spec in items]
        return await self.base.score_detailed(adapted, alone=alone)

    async def generate(
        self, items: Sequence[GenerateItem], *, alone: bool | None = None
    ) -> list[Generation]:
        adapted = [dataclasses.replace(item, adapter=self.adapter) for item in items]
        generations = await self.base.generate(adapted, alone=alone)
        for generation in generations:  # every token came from this version of the adapter
            if generation.versions is not None and generation.token_ids:
                generation.versions = version_spans(
                    [self.adapter.version] * len(generation.token_ids)
                )
        return generations

    async def check(self, fresh_s: float) -> None:
        await self.base.check(fresh_s)

    async def aclose(self) -> None:
        """Nothing of its own to release: the base closes the engine."""


class ModelPair:
    """Scores the same batch with the policy and the reference, concurrently. Both passes always
    see identical batches, so equal weights give bit-identical log-probs (KL exactly 0)."""

    def __init__(
        self, policy: ServedModel, reference: ServedModel, batching: BatchingConfig | None
    ) -> None:
        self.policy = policy
        self.reference = reference
        self.batcher: Batcher[Sequence[int], tuple[list[float], list[float]]] | None = None
        if batching is not None:
            # grouped as detailed scoring is, so both engines see the same calls
            _, grouped, _ = batching_policy(policy.backend.capabilities, batching)
            self.batcher = Batcher("policy+reference/score", self._score_batch, len, grouped)

    async def _score_batch(
        self, sequences: list[Sequence[int]]
    ) -> list[tuple[list[float], list[float]]]:
        policy, reference = await asyncio.gather(
            self.policy.backend.score(sequences), self.reference.backend.score(sequences)
        )
        return list(zip(policy, reference, strict=True))

    async def score(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[tuple[list[float], list[float]]]:
        if self.policy.invariant:  # each sequence alone, on both models
            return await _one_at_a_time(self._score_batch, sequences)
        if self.batcher is None:
            return await _direct(self._score_batch(list(sequences)))
        return await self.batcher.submit(sequences)

    async def aclose(self) -> None:
        if self.batcher is not None:
            await self.batcher.aclose()


class AdapterPair:
    """A LoRA adapter and its reference, for KL: the base with the adapter off, in the same
    model call as the adapter's rows (a zero adapter's KL is then exactly 0), or a separately
    configured reference model, called beside it."""

    def __init__(self, policy: AdaptedModel, reference: ServedModel) -> None:
        self.policy = policy
        self.reference = reference

    async def score(
        self, sequences: Sequence[Sequence[int]]
    ) -> list[tuple[list[float], list[float]]]:
        if self.reference is self.policy.base:
            adapter = ScoreSpec(adapter=self.policy.adapter)
            rows = [(s, adapter) for s in sequences] + [(s, ScoreSpec()) for s in sequences]
            scored = await _direct(self.reference.backend.score_detailed(rows))
            values = [s.log_probs.tolist() for s in scored]
            return list(zip(values[: len(sequences)], values[len(sequences) :], strict=True))
        policy, reference = await asyncio.gather(
            self.policy.score(sequences), self.reference.score(sequences)
        )
        return list(zip(policy, reference, strict=True))
