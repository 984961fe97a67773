#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. CI runs exactly this.
# With CI=true (or RLSERVE_TEST_VLLM=1) the vLLM tests also run, in their own venv; with
# CI=true (or RLSERVE_TEST_TORCHRL=1) so do the tests beside the real TorchRL library; with
# CI=true (or RLSERVE_TEST_DOCKER=1) the images are built and run (scripts/docker-smoke.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# The Docker smoke test (tests/docker/test_smoke.py) needs an engine and Compose v2: CI
# installs them from Debian (the test skips, saying why, where they are missing).
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_DOCKER:-0}" = "1" ]; then
  if [ "$(id -u)" = "0" ]; then
    ./scripts/docker-deps.sh || echo "note: docker-deps failed; the Docker smoke test will skip" >&2
  fi
fi
./scripts/lint.sh
./scripts/check-docker.sh
.venv/bin/python -m pytest "$@"
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_TORCHRL:-0}" = "1" ]; then
  ./scripts/test-torchrl.sh
fi
if [ "${CI:-}" = "true" ] || [ "${RLSERVE_TEST_VLLM:-0}" = "1" ]; then
  ./scripts/test-vllm.sh
fi
