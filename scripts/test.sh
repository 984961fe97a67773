#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. CI runs exactly this.
# With CI=true (or RLSERVE_TEST_VLLM=1) the vLLM tests also run, in their own venv; with
# CI=true (or RLSERVE_TEST_TORCHRL=1) so do the tests beside the real TorchRL library.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/lint.sh
./scripts/check-docker.sh
.venv/bin/python -m pytest "$@"
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_TORCHRL:-0}" = "1" ]; then
  ./scripts/test-torchrl.sh
fi
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_VLLM:-0}" = "1" ]; then
  ./scripts/test-vllm.sh
fi
