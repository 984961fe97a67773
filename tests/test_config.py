"""Settings: groups read from `RLSERVE_<GROUP>__<FIELD>`, the old flat names still working with
a warning that names the new one, and the checks done at start-up."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from app.config import Settings
from app.deprecated_settings import RENAMED


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


def test_an_old_env_name_still_works_and_warns_naming_the_new_one(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RLSERVE_TOOL_TIMEOUT_S", "7")
    with (
        caplog.at_level(logging.WARNING, logger="app.deprecated_settings"),
        pytest.warns(DeprecationWarning) as warned,
    ):
        settings = Settings()
    assert settings.tools.timeout_s == 7.0
    message = "RLSERVE_TOOL_TIMEOUT_S is deprecated: use RLSERVE_TOOLS__TIMEOUT_S"
    assert [str(w.message) for w in warned] == [message]
    assert message in caplog.text  # the start-up log says it too


def test_the_new_name_wins_over_the_old(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSERVE_MAX_QUEUE", "5")
    monkeypatch.setenv("RLSERVE_BATCHING__MAX_QUEUE", "9")
    with pytest.warns(DeprecationWarning, match="use RLSERVE_BATCHING__MAX_QUEUE"):
        assert Settings().batching.max_queue == 9


def test_the_old_batching_timeout_in_ms_becomes_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLSERVE_BATCHING_TIMEOUT_MS", "20")
    with pytest.warns(DeprecationWarning, match="use RLSERVE_BATCHING__TIMEOUT_S"):
        settings = Settings()
    assert settings.batching.timeout_s == pytest.approx(0.02)
    config = settings.batching.config()
    assert config is not None and config.timeout_s == pytest.approx(0.02)


def test_the_old_batching_switch_is_not_taken_for_the_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RLSERVE_BATCHING", "false")
    with pytest.warns(DeprecationWarning, match="use RLSERVE_BATCHING__ENABLED"):
        assert Settings().batching.enabled is False


def test_old_flat_keywords_still_work_and_warn() -> None:
    with pytest.warns(DeprecationWarning, match=r"use Settings\(storage=\{'data_dir': \.\.\.\}\)"):
        settings = Settings(data_dir="/tmp/rlserve-x", storage={"session_store": "redis://r"})
    assert str(settings.storage.data_dir) == "/tmp/rlserve-x"
    assert settings.storage.session_store == "redis://r"


def test_every_old_name_maps_to_a_field() -> None:
    fields = {group: type(model).model_fields for group, model in Settings()}
    for old, renamed in RENAMED.items():
        assert renamed.field in fields[renamed.group], old


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
