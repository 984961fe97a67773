"""A backend with chosen log-probs and scripted generations: service logic (env KL penalties,
rollout versions, advantages) tested against numbers known by construction, with no model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from app.config import Settings
from app.engine.base import Backend
from app.engine.builtin_model import build_tokenizer
from app.engine.served import ModelPair
from app.engine.types import GenerateItem, Generation, ModelInfo
from app.main import create_app

LogProb = Callable[[int], float]


class FakeBackend(Backend):
    """`log_prob(t)` is log p of token t at any position (position 0 is 0.0). Generation writes
    `reply` (cut at max_new_tokens), each token with its `log_prob`; `on_generate` runs at
    the start of every call (a test's hook, e.g. to start a weight update). The tokenizer is
    the built-in model's unless one is given."""

    def __init__(
        self,
        name: str,
        log_prob: LogProb,
        reply: Sequence[int] = (72, 105, 33),
        on_generate: Callable[[int], Awaitable[None] | None] | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.tokenizer = build_tokenizer() if tokenizer is None else tokenizer
        self.info = ModelInfo(
            name=name,
            source="fake",
            backend="fake",
            dtype="float32",
            device="cpu",
            max_model_len=4096,
            vocab_size=len(self.tokenizer),
        )
        self.log_prob = log_prob
        self.reply = list(reply)
        self.on_generate = on_generate
        self.calls = 0

    async def generate(self, items: Sequence[GenerateItem]) -> list[Generation]:
        if self.on_generate is not None:
            waited = self.on_generate(self.calls)
            if waited is not None:
                await waited
        self.calls += 1
        out = []
        for item in items:
            ids = self.reply[: item.config.max_new_tokens]
            finish = "length" if len(ids) == item.config.max_new_tokens else "stop"
            hit = self._stop_hit(ids, item.config.stop_sequences)
            if hit is not None:  # (as engines stop: at the token that completes it)
                ids, finish, stop_reason = ids[: hit[0]], "stop", hit[1]
            else:
                stop_reason = None
            values = [self.log_prob(t) for t in ids]
            out.append(Generation(ids, values, None, finish, stop_reason=stop_reason))
        return out

    def _stop_hit(self, ids: list[int], stops: Sequence[str]) -> tuple[int, str] | None:
        """Where the first stop string is complete in `ids`' text (tokens to keep), and it."""
        for end in range(1, len(ids) + 1) if stops else ():
            text = self.tokenizer.decode(ids[:end])
            if hit := next((stop for stop in stops if stop in text), None):
                return end, hit
        return None

    async def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        return [[0.0, *(self.log_prob(t) for t in seq[1:])] for seq in sequences]


@asynccontextmanager
async def fake_app(
    tmp: Path, policy: FakeBackend, reference: FakeBackend, **groups: dict[str, Any]
) -> AsyncIterator[FastAPI]:
    """The real app and services with the fake models in place of loaded ones; `groups` change
    settings (`envs={"max_turns": 5}`)."""
    settings = Settings(
        models={"model": "builtin:tiny", "cache_dir": tmp / "cache"},
        storage={"data_dir": tmp / "data"},
        batching={"enabled": False},
    ).replace(**groups)
    app = create_app(settings, load_models=False)
    async with app.router.lifespan_context(app):
        registry = app.state.registry
        registry.add(policy)
        registry.add(reference)
        registry.pair = ModelPair(registry.models["policy"], registry.models["reference"], None)
        registry.status = "ready"
        yield app
