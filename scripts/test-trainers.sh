#!/usr/bin/env bash
# Set up .venv-trainers and run the trainers' own clients against rlserve (tests/trainers).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup-trainers.sh
RLSERVE_TRAINERS_SUITE=1 .venv-trainers/bin/python -m pytest -m trainers tests/trainers \
  --durations=10 "$@"
