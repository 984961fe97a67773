"""scripts/apt-mirror.sh finds the Debian mirror a host's apt already uses, so the image
scripts name no host of their own: deb822 and one-line sources, disabled entries, security and
update suites, and the override."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "apt-mirror.sh"


def _mirror(apt: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("RLSERVE_APT_MIRROR", "DEBIAN_MIRROR")
    }
    return subprocess.run(
        [str(SCRIPT), str(apt)], env={**clean, **env}, capture_output=True, text=True, timeout=30
    )


def _apt(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


DEB822 = """\
Types: deb
URIs: http://security.example/debian-security
Suites: bookworm-security
Components: main

Types: deb
Enabled: no
URIs: http://disabled.example/debian
Suites: bookworm
Components: main

Types: deb-src
URIs: http://sources-only.example/debian
Suites: bookworm
Components: main

# the site's mirror
Types: deb
URIs: http://mirror.corp.example/debian/
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By:
 -----BEGIN PGP PUBLIC KEY BLOCK-----
 uris: http://inside.a.key/
"""


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"sources.list.d/debian.sources": DEB822}, "http://mirror.corp.example/debian"),
        (
            {
                "sources.list": "deb http://sec.example/debian-security bookworm-security main\n"
                "# deb http://commented.example/debian bookworm main\n"
                "deb [arch=amd64 signed-by=/k.gpg] file:///srv/debian bookworm main\n"
            },
            "file:///srv/debian",
        ),
        (
            {
                "sources.list.d/aaa-node.sources": "Types: deb\nURIs: https://repo.example/node\n"
                "Suites: nodistro\nComponents: main\n",
                "sources.list.d/debian.sources": DEB822,
            },
            # Read first, but a third party's repository: its suite is not a Debian release.
            "http://mirror.corp.example/debian",
        ),
    ],
    ids=["deb822", "one-line", "first-of-several"],
)
def test_the_mirror_comes_from_the_hosts_apt_sources(
    tmp_path: Path, files: dict[str, str], expected: str
) -> None:
    done = _mirror(_apt(tmp_path, files))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expected


def test_no_archive_among_the_sources_is_an_error_naming_the_override(tmp_path: Path) -> None:
    done = _mirror(
        _apt(tmp_path, {"sources.list": "deb http://s.example/x bookworm-security main\n"})
    )
    assert done.returncode != 0 and "RLSERVE_APT_MIRROR" in done.stderr


def test_the_override_wins(tmp_path: Path) -> None:
    apt = _apt(tmp_path, {"sources.list.d/debian.sources": DEB822})
    done = _mirror(apt, RLSERVE_APT_MIRROR="http://override.example/debian")
    assert done.stdout.strip() == "http://override.example/debian"


def test_the_image_scripts_name_no_mirror_of_their_own() -> None:
    for name in ("docker-base.sh", "docker-deps.sh"):
        text = (ROOT / "scripts" / name).read_text()
        assert "apt-mirror.sh" in text and "deb.debian.org" not in text, name
