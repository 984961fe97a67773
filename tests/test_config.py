"""Settings: groups read from `RLSERVE_<GROUP>__<FIELD>`, a field named without its group
refused with the grouped name, and the checks done at start-up."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from app.config import Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No RLSERVE_* variable of the shell running the tests leaks in."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("RLSERVE_"):
            monkeypatch.delenv(name)


def test_groups_are_read_from_nested_env_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSERVE_TOOLS__TIMEOUT_S", "3")
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "a, b,")
    monkeypatch.setenv("RLSERVE_BATCHING__ENABLED", "false")
    settings = Settings()
    assert settings.tools.timeout_s == 3.0
    assert settings.auth.api_keys == ["a", "b"]
    assert settings.batching.enabled is False and settings.batching.config() is None


def test_a_field_named_without_its_group_is_a_warning_naming_the_grouped_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RLSERVE_PORT", "9000")
    monkeypatch.setenv("RLSERVE_MAX_BYTES", "1")  # a field two groups have: both are named
    monkeypatch.setenv("RLSERVE_BATCHING", "false")  # a group, not a field
    monkeypatch.setenv("RLSERVE_URL", "http://elsewhere:8000")  # the client's: not a setting
    with caplog.at_level(logging.WARNING, logger="app.config"):
        settings = Settings()
    assert settings.http.port == 8000 and settings.batching.enabled  # none of them was read
    assert caplog.messages == [
        "RLSERVE_BATCHING is not read: a group's fields are RLSERVE_BATCHING__<FIELD>",
        "RLSERVE_MAX_BYTES is not read: settings are grouped, the server reads "
        "RLSERVE_DATASETS__MAX_BYTES or RLSERVE_WEIGHTS__MAX_BYTES",
        "RLSERVE_PORT is not read: settings are grouped, the server reads RLSERVE_HTTP__PORT",
    ]


def test_a_flat_keyword_names_its_group() -> None:
    with pytest.raises(
        TypeError, match=r"Settings\(port=\.\.\.\): use Settings\(http=\{'port': \.\.\.\}\)"
    ):
        Settings(port=9000)
    with pytest.raises(TypeError, match="not a settings group"):
        Settings(nonsense=1)


def test_replace_validates_again() -> None:
    settings = Settings()
    assert settings.replace(tools={"timeout_s": 3}).tools.timeout_s == 3.0
    assert settings.tools.timeout_s == 5.0  # the original is unchanged
    with pytest.raises(ValidationError, match="min_batch_size"):
        settings.replace(batching={"min_batch_size": 64, "max_batch_size": 8})


def test_limits_are_checked_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSERVE_LIMITS__DEFAULT_MAX_NEW_TOKENS", "600")
    monkeypatch.setenv("RLSERVE_LIMITS__MAX_NEW_TOKENS", "512")
    with pytest.raises(ValidationError, match=r"default_max_new_tokens \(600\) exceeds"):
        Settings()


def test_an_unknown_field_of_a_group_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSERVE_TOOLS__TIMEOUT", "3")
    with pytest.raises(ValidationError, match=r"tools\.timeout"):
        Settings()
