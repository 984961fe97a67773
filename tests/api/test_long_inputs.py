"""A text too long for the model is refused by its length before any tokenizer sees it, on
every route that tokenizes, naming its field; and one request's tokenizing never queues the
short requests behind it (the tokenizer's lane runs the cheapest waiting call first:
tests/engine/test_lane.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from app.config import Settings
from tests.conftest import served_app

MAX_MODEL_LEN = 300
LONG = "a" * 10_000_000  # 10 MB: seconds of tokenizing, were it tokenized


@pytest.fixture(scope="module")
async def client(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    config = settings.replace(
        models={
            "reward_model": "builtin:tiny-reward",
            "load_reference": False,
            "max_model_len": MAX_MODEL_LEN,
        },
        storage={"data_dir": settings.storage.data_dir / "long-inputs"},
        http={"max_body_bytes": 64 << 20},
    )
    async with served_app(config) as c:
        yield c


class Watched:
    """A tokenizer that records the length of every text it is handed (then does its work)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.longest = 0
        self.calls: list[int] = []
        """The length of each text it was called on, in order."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def _seen(self, value: Any) -> None:
        if isinstance(value, str):
            self.longest = max(self.longest, len(value))
        elif isinstance(value, list | tuple):
            for item in value:
                self._seen(item)
        elif isinstance(value, dict):
            for item in value.values():
                self._seen(item)

    def __call__(self, text: Any, *args: Any, **kwargs: Any) -> Any:
        self._seen(text)
        if isinstance(text, str):
            self.calls.append(len(text))
        return self._tokenizer(text, *args, **kwargs)

    def apply_chat_template(self, conversation: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tokenize", True):
            self._seen(conversation)
        return self._tokenizer.apply_chat_template(conversation, *args, **kwargs)


CASES = [
    ("/v1/generate", {"text": ["hi", LONG], "max_tokens": 2}, "text[1]"),
    ("/v1/generate", {"messages": [[{"role": "user", "content": LONG}]]}, "messages[0]"),
    ("/v1/logprobs", {"text": [LONG]}, "text[0]"),
    ("/v1/logprobs", {"prompt_text": ["q"], "response_text": [LONG]}, "response_text[0]"),
    ("/v1/completions", {"model": "policy", "prompt": LONG, "max_tokens": 2}, "prompt[0]"),
    (
        "/v1/chat/completions",
        {"model": "policy", "messages": [{"role": "user", "content": LONG}], "max_tokens": 2},
        "messages",
    ),
    ("/tokenize", {"prompt": LONG}, "prompt"),
    ("/v1/rewards", {"text": ["fine", LONG]}, "text[1]"),
    (
        "/v1/rewards",
        {"messages": [[{"role": "user", "content": "q"}, {"role": "assistant", "content": LONG}]]},
        "messages[0]",
    ),
    ("/slime/reward", {"prompt": "q", "response": LONG}, "response"),
    ("/get_reward", {"query": ["fine", LONG]}, "query"),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES)
async def test_a_text_too_long_is_refused_before_it_is_tokenized(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    registry = client.app.state.registry  # type: ignore[attr-defined]
    preparers = [registry.get("policy").preparer, registry.get_reward("reward", "model").preparer]
    watched = []
    for preparer in preparers:
        watched.append(Watched(preparer.tokenizer))
        preparer.tokenizer = watched[-1]
    try:
        refused = await client.post(path, json=body)
    finally:
        for preparer, watcher in zip(preparers, watched, strict=True):
            preparer.tokenizer = watcher._tokenizer
    assert refused.status_code in (400, 422), refused.text
    text = refused.text
    assert field in text and "maximum length of 300 tokens" in text, text
    assert "refused before tokenizing" in text
    bound = max(p.max_model_len * p.max_token_chars for p in preparers)
    assert all(w.longest <= bound for w in watched), [w.longest for w in watched]
    # and the server serves on
    fine = await client.post("/v1/logprobs", json={"text": ["fine"]})
    assert fine.status_code == 200


async def test_a_long_request_waiting_to_tokenize_does_not_hold_up_a_short_one(
    client: httpx.AsyncClient,
) -> None:
    """While the tokenizer is busy, a long request (as long as the model takes) and then a
    short one arrive: the short one is prepared first."""
    preparer = client.app.state.registry.get("policy").preparer  # type: ignore[attr-defined]
    watcher = preparer.tokenizer = Watched(preparer.tokenizer)
    busy, release = threading.Event(), threading.Event()

    def occupy() -> None:
        busy.set()
        release.wait(30)

    try:
        held = asyncio.ensure_future(preparer.off_loop(occupy))
        await asyncio.to_thread(busy.wait, 30)
        longest = "b" * (MAX_MODEL_LEN - 10)  # (the tiny model's tokenizer: a token a char)
        long_request = asyncio.ensure_future(
            client.post("/v1/logprobs", json={"text": [longest] * 8})
        )
        await asyncio.sleep(0.2)  # (queued behind the held call)
        short_request = asyncio.ensure_future(client.post("/v1/logprobs", json={"text": ["x"]}))
        await asyncio.sleep(0.2)
        release.set()
        await held
        answers = await asyncio.gather(long_request, short_request)
    finally:
        release.set()
        preparer.tokenizer = watcher._tokenizer
    assert [a.status_code for a in answers] == [200, 200]
    assert watcher.calls == [1] + [len(longest)] * 8, watcher.calls
