#!/usr/bin/env bash
# Set up .venv-torchrl and run the torchrl-marked tests there (TorchRL's own classes beside
# the service on the same model).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-torchrl.sh
# TorchRL and tensordict warn about their own internals (nested tensors, deprecations).
.venv-torchrl/bin/python -m pytest -m torchrl -W "ignore::UserWarning" \
  -W "ignore::DeprecationWarning" -W "ignore::FutureWarning" "$@"
