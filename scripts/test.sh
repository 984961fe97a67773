#!/usr/bin/env bash
# Set up (if needed), lint, type-check and run the test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/lint.sh
.venv/bin/python -m pytest "$@"
