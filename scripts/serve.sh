#!/usr/bin/env bash
# Set up (if needed) and serve; with no --model this serves the built-in demo model.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/rlserve serve "$@"
