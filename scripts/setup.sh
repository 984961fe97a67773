#!/usr/bin/env bash
# Create .venv and install rlserve with its test tools. Idempotent: re-runs only when
# pyproject.toml changed. CPU machines get the CPU build of torch (RLSERVE_TORCH overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/system-deps.sh

venv=${RLSERVE_VENV:-.venv}
torch_spec=${RLSERVE_TORCH:-torch==2.13.0}  # what scripts/install.sh installs
stamp="$venv/.rlserve-installed"
wanted="$(cat pyproject.toml clients/python/pyproject.toml scripts/install.sh scripts/install-model.sh app/engine/smollm2.py | sha256sum | cut -c1-16) $torch_spec"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
scripts/install.sh "$venv" test,bench,docs,harness,distributed,ifeval --editable
"$venv/bin/python" -m pip install --quiet -e "clients/python[torch]"
echo "$wanted" > "$stamp"
