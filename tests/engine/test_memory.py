"""Large backend calls hand their freed heap back to the OS (glibc's malloc_trim); small ones
do not pay for it."""

from __future__ import annotations

import pytest

from app.engine.transformers import memory


def test_only_large_calls_trim(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: trims.append)
    memory.release_after(memory.LARGE_CALL_TOKENS - 1)
    assert trims == []
    memory.release_after(memory.LARGE_CALL_TOKENS)
    assert trims == [0]


def test_glibc_trim_is_found_here() -> None:
    """This project's machines and images run glibc: the trim must really be available."""
    assert memory._malloc_trim() is not None
