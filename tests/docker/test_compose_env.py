"""What `docker compose` hands the server, read from `docker compose config` (no engine
needed): every variable of the operator's env file reaches the container, and nothing else
of theirs overrides it, whichever file compose reads for its own interpolation; so the
server's own start-up checks see a misspelt or old name, an empty key list, a missing key,
and a name the file leaves unset stays unset (never an empty key list). The started
container refusing each of them: scripts/docker_smoke.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.config import Settings, SettingsNameError
from app.ops.auth import OpenStart, check_exposure

ROOT = Path(__file__).resolve().parents[2]


def _compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    not _compose_v2(), reason="no Docker Compose v2 (scripts/docker-deps.sh installs it)"
)
SERVICES = {"rlserve": [], "rlserve-cpu": ["--profile", "cpu"], "rlserve-ray": ["--profile", "ray"]}


def container_env(
    tmp_path: Path, settings: str, service: str, interpolated: Path | None = None
) -> dict[str, str]:
    """The environment compose gives `service`'s container, from an env file holding
    .env.example and then `settings` (the operator's .env); compose interpolates the compose
    file from `interpolated` (by default that same file)."""
    env_file = tmp_path / "operator.env"
    env_file.write_text((ROOT / ".env.example").read_text() + settings)
    environment = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(tmp_path),
        "RLSERVE_ENV_FILE": str(env_file),
    }
    done = subprocess.run(
        [
            "docker", "compose", "-p", "envcheck", "--env-file", str(interpolated or env_file),
            "-f", str(ROOT / "docker-compose.yml"), *SERVICES[service],
            "config", "--format", "json",
        ],
        capture_output=True, text=True, env=environment, cwd=ROOT, check=True,
    )  # fmt: skip
    config: dict[str, Any] = json.loads(done.stdout)
    variables = config["services"][service]["environment"]
    return {name: value for name, value in variables.items() if value is not None}


def start_check(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Settings:
    """The server's own start-up checks, in a container with `env` (the images listen on
    0.0.0.0)."""
    for name in [n for n in os.environ if n.upper().startswith("RLSERVE_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    check_exposure(settings.auth, "0.0.0.0")
    return settings


@pytest.mark.parametrize("service", list(SERVICES))
def test_every_variable_of_the_env_file_reaches_the_container(tmp_path: Path, service: str) -> None:
    env = container_env(
        tmp_path,
        "RLSERVE_AUTH__API_KEY=typo\nRLSERVE_API_KEYS=old\nRLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST=7\n"
        "RLSERVE_AUTH__METRICS_AUTH=true\n",
        service,
    )
    assert env["RLSERVE_AUTH__API_KEY"] == "typo" and env["RLSERVE_API_KEYS"] == "old"
    assert env["RLSERVE_LIMITS__MAX_ITEMS_PER_REQUEST"] == "7"
    assert env["RLSERVE_AUTH__METRICS_AUTH"] == "true"
    # Unset in the file and the shell: unset in the container (not an empty key list).
    assert "RLSERVE_AUTH__API_KEYS" not in env and "RLSERVE_AUTH__ADMIN_API_KEYS" not in env


@pytest.mark.parametrize(
    ("settings", "refusal", "said"),
    [
        ("", OpenStart, "no API keys, and the server would listen on 0.0.0.0"),
        ("RLSERVE_API_KEYS=k\n", SettingsNameError, "RLSERVE_API_KEYS is not read"),
        ("RLSERVE_AUTH__API_KEY=k\n", SettingsNameError, "did you mean RLSERVE_AUTH__API_KEYS"),
        ("RLSERVE_AUTH__API_KEYS=\n", ValueError, "is set but holds no key"),
        ("RLSERVE_AUTH__API_KEYS= , \n", ValueError, "is set but holds no key"),
    ],
)
def test_the_server_refuses_what_the_operator_got_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: str, refusal: type, said: str
) -> None:
    env = container_env(tmp_path, settings, "rlserve-cpu")
    with pytest.raises(refusal, match=said):
        start_check(monkeypatch, env)


@pytest.mark.parametrize("service", list(SERVICES))
def test_keys_from_the_env_file_start_a_closed_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: str
) -> None:
    """Whichever file compose interpolates from (`--env-file .env.example` beside
    RLSERVE_ENV_FILE=prod.env), the keys of the file the containers read reach them."""
    shipped = ROOT / ".env.example"
    from_file = container_env(tmp_path, "RLSERVE_AUTH__API_KEYS=a,b\n", service, shipped)
    assert start_check(monkeypatch, from_file).auth.api_keys == ["a", "b"]
    opened = container_env(tmp_path, "RLSERVE_AUTH__ALLOW_NO_KEYS=true\n", service, shipped)
    assert start_check(monkeypatch, opened).auth.allow_no_keys is True
