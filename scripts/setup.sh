#!/usr/bin/env bash
# Create .venv and install rlserve with its test tools. Idempotent: re-runs only when
# pyproject.toml changed. CPU machines get the CPU build of torch (RLSERVE_TORCH overrides).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${RLSERVE_VENV:-.venv}
torch_spec=${RLSERVE_TORCH:-torch==2.13.0}
stamp="$venv/.rlserve-installed"
wanted="$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -c1-16) $torch_spec"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet "$torch_spec"
fi
"$venv/bin/python" -m pip install --quiet -e ".[test,bench]" -e "clients/python[torch]"
echo "$wanted" > "$stamp"
