"""Tokenizing, templating and decoding run on each model's tokenizer thread, never on the
event loop: a request with a large input cannot stall every other request."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.common.inputs import InputPreparer
from tests.fake.backend import FakeBackend, fake_app


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/generate", {"text": ["hello there"], "max_new_tokens": 2}),
        ("/v1/logprobs", {"text": ["hello there"]}),
        ("/v1/kl", {"text": ["hello there"], "assistant_only": False}),
    ],
)
async def test_token_work_runs_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, route: str, body: dict[str, Any]
) -> None:
    threads: set[str] = set()
    for name in ("encode", "decode"):
        real = getattr(InputPreparer, name)

        def spy(self: InputPreparer, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            threads.add(threading.current_thread().name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(InputPreparer, name, spy)
    pair = FakeBackend("policy", lambda t: -0.5), FakeBackend("reference", lambda t: -0.7)
    async with fake_app(tmp_path, *pair) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake") as client:
            answer = await client.post(route, json=body)
    assert answer.status_code == 200, answer.text
    assert threads and all(t.startswith("tokenizer") for t in threads), threads
