"""Settings: groups read from `RLSERVE_<GROUP>__<FIELD>`; any other `RLSERVE_*` variable but
rlserve's own tools' stops the start, naming the name the server reads; and the checks done at
start-up."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import Settings, SettingsNameError


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


@pytest.mark.parametrize(
    ("variable", "problem"),
    [
        # the name older deployments used: no server without its keys
        ("RLSERVE_API_KEYS", "settings are grouped, the server reads RLSERVE_AUTH__API_KEYS"),
        (  # a field two groups have: both are named
            "RLSERVE_MAX_BYTES",
            "the server reads RLSERVE_DATASETS__MAX_BYTES or RLSERVE_WEIGHTS__MAX_BYTES",
        ),
        ("RLSERVE_BATCHING", "a group's fields are RLSERVE_BATCHING__<FIELD>"),
        ("RLSERVE_AUTH__API_KEYZ", "no field 'api_keyz' (did you mean RLSERVE_AUTH__API_KEYS?)"),
        ("RLSERVE_ATUH__API_KEYS", "no settings group 'atuh' (did you mean RLSERVE_AUTH__…?)"),
        ("RLSERVE_NONSENSE", "the server's settings are RLSERVE_<GROUP>__<FIELD>"),
    ],
)
def test_a_variable_the_server_does_not_read_stops_the_start_naming_what_it_reads(
    monkeypatch: pytest.MonkeyPatch, variable: str, problem: str
) -> None:
    monkeypatch.setenv(variable, "a")
    with pytest.raises(SettingsNameError) as refused:
        Settings()
    assert str(refused.value).startswith(f"{variable} is not read: ")
    assert problem in str(refused.value)


def test_the_client_key_beside_a_server_without_keys_stops_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """RLSERVE_API_KEY is the client's: beside a server without keys it most likely meant
    the server's. With the server's keys set, it is the client's, as named."""
    monkeypatch.setenv("RLSERVE_API_KEY", "k")
    with pytest.raises(ValueError, match="RLSERVE_API_KEY is the Python client's key"):
        Settings()
    monkeypatch.setenv("RLSERVE_AUTH__API_KEYS", "k")
    assert Settings().auth.api_keys == ["k"]


def test_the_project_tools_variables_start_a_server_and_look_alikes_warn(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("RLSERVE_PORT", "9000")  # the compose file's published port
    monkeypatch.setenv("RLSERVE_URL", "http://elsewhere:8000")  # the client's
    monkeypatch.setenv("RLSERVE_TEST_VLLM", "1")  # a test suite's
    monkeypatch.setenv("RLSERVE_TRAINERS_VENV", "/somewhere")  # a script's
    with caplog.at_level(logging.WARNING, logger="app.config"):
        settings = Settings()
    assert settings.http.port == 8000  # none of them was read
    assert caplog.messages == [
        "RLSERVE_PORT is not read by the server, which reads RLSERVE_HTTP__PORT"
    ]
    caplog.clear()
    monkeypatch.setenv("RLSERVE_HTTP__PORT", "8000")  # (the images set it; compose's port too)
    with caplog.at_level(logging.WARNING, logger="app.config"):
        Settings()
    assert caplog.messages == []


@pytest.mark.parametrize("variable", ["RLSERVE_TEST_SOMETHING", "RLSERVE_FUZZ_X", "RLSERVE_X_VENV"])
def test_a_tools_look_alike_is_refused_like_any_unread_name(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """Tools' names are listed whole: no prefix or suffix lets an unknown name through."""
    monkeypatch.setenv(variable, "1")
    with pytest.raises(SettingsNameError, match=f"{variable} is not read"):
        Settings()


@pytest.mark.parametrize("variable", ["RLSERVE_AUTH__API_KEYS", "RLSERVE_AUTH__ADMIN_API_KEYS"])
@pytest.mark.parametrize("value", ["", " ", " , ", ",,"])
def test_a_key_list_set_to_no_key_stops_the_start(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    """Set but empty, or separators only: never read as "no keys"."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match="is set but holds no key"):
        Settings()


def test_other_empty_variables_are_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """compose passes a .env line `NAME=` as an empty value: the setting's default."""
    monkeypatch.setenv("RLSERVE_MODELS__MODEL", "")
    monkeypatch.setenv("RLSERVE_BATCHING__MAX_BATCH_SIZE", "")
    settings = Settings()
    assert settings.models.model == Settings.model_fields["models"].default_factory().model
    assert settings.batching.max_batch_size == 32


@pytest.mark.parametrize(
    ("host", "keys", "allowed", "outcome"),
    [
        ("127.0.0.1", "", False, "warns"),
        ("localhost", "", False, "warns"),
        ("::1", "", False, "warns"),
        ("127.0.0.2", "", False, "warns"),
        ("0.0.0.0", "", False, "refused"),
        ("::", "", False, "refused"),
        ("10.1.2.3", "", False, "refused"),
        ("myhost.example", "", False, "refused"),
        (None, "", False, "refused"),  # a Ray Serve config's proxy: out of sight
        ("0.0.0.0", "", True, "warns"),
        (None, "", True, "warns"),
        ("0.0.0.0", "k", False, "quiet"),
        ("127.0.0.1", "k", False, "quiet"),
    ],
)
def test_a_server_without_keys_starts_open_only_on_loopback_or_on_purpose(
    caplog: pytest.LogCaptureFixture, host: str | None, keys: str, allowed: bool, outcome: str
) -> None:
    from app.config_groups import AuthSettings
    from app.ops.auth import OpenStart, check_exposure

    auth = AuthSettings(api_keys=keys or [], allow_no_keys=allowed)
    with caplog.at_level(logging.WARNING, logger="app.ops.auth"):
        if outcome == "refused":
            with pytest.raises(OpenStart, match="RLSERVE_AUTH__ALLOW_NO_KEYS=true"):
                check_exposure(auth, host)
        else:
            check_exposure(auth, host)
    if outcome == "warns":
        (message,) = caplog.messages
        assert "no API keys" in message
    else:
        assert caplog.messages == []


def test_every_rlserve_variable_the_project_names_is_a_setting_or_a_tools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The names in the project's own code (scripts, compose, Dockerfiles, client, benchmarks,
    tests) start a server: a tool's new variable is added to TOOL_VARIABLES, or it stops
    every server started beside it."""
    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    names: set[str] = set()
    code = ("scripts/", "docker/", "docker-compose.yml", "app/", "clients/", "bench/", "tests/")
    for relative in tracked:
        path = root / relative
        wrong_on_purpose = {
            "app/config.py",
            "tests/test_config.py",
            "tests/docker/test_compose_env.py",
            "scripts/docker_smoke.py",
            "tests/e2e/test_serve.py",
        }
        if not relative.startswith(code) or relative in wrong_on_purpose:
            continue  # (those that spell wrong names on purpose)
        if path.suffix in {".png", ".svg", ".json"}:
            continue
        text = path.read_text(errors="replace") if path.is_file() else ""
        names |= set(re.findall(r"RLSERVE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])", text))
    assert {"RLSERVE_URL", "RLSERVE_PORT", "RLSERVE_AUTH__API_KEYS"} <= names
    for name in sorted(names - {"RLSERVE_API_KEY"}):  # (the client's: the test above)
        monkeypatch.setenv(name, "1" if not name.endswith("PORT") else "8000")
        try:
            Settings()
        except SettingsNameError as refused:
            raise AssertionError(f"{name} stops a server: {refused}") from None
        except ValueError:
            pass  # a setting's name with a value that is not its type: read, so fine
        monkeypatch.delenv(name)


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
    with pytest.raises(SettingsNameError, match="did you mean RLSERVE_TOOLS__TIMEOUT_S"):
        Settings()
    monkeypatch.delenv("RLSERVE_TOOLS__TIMEOUT")
    with pytest.raises(ValidationError, match=r"tools\.timeout"):  # and as an override
        Settings(tools={"timeout": 3})
