#!/usr/bin/env bash
# Create .venv-torchrl: the real TorchRL library (which needs tensordict<0.15) beside rlserve and
# its client, for the tests that run TorchRL's own classes next to the service.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${RLSERVE_TORCHRL_VENV:-.venv-torchrl}
torchrl_spec=${RLSERVE_TORCHRL:-torchrl==0.14.1}
stamp="$venv/.rlserve-installed"
extras="test,ifeval,bench"
wanted="$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -c1-16) $torchrl_spec [$extras]"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet torch==2.13.0 "tensordict<0.15" "$torchrl_spec"
# One editable install of the project at a time (scripts/test.sh builds venvs side by side:
# each writes the same egg-info directories).
# (the silenced UserWarning: setuptools' editable-install notice, see install.sh)
PYTHONWARNINGS=ignore::UserWarning flock pyproject.toml \
  "$venv/bin/python" -m pip install --quiet -e ".[$extras]" -e "clients/python[torch]"
echo "$wanted" > "$stamp"
