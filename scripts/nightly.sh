#!/usr/bin/env bash
# The nightly-style fuzz run: the schemathesis contract test with a large, randomized budget
# per route (RLSERVE_FUZZ_EXAMPLES, default 300) against a real server on the built-in model.
# Not part of CI's run (it takes tens of minutes); run it on a schedule or before a release.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
export RLSERVE_FUZZ_EXAMPLES="${RLSERVE_FUZZ_EXAMPLES:-300}" RLSERVE_FUZZ_RANDOM=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/contract "$@"
