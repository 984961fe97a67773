#!/usr/bin/env bash
# Create .venv and install rlserve into it. Idempotent: re-runs only when pyproject.toml (or
# what else goes into the install) changed. CPU machines get the CPU build of torch
# (RLSERVE_TORCH overrides).
#
#   scripts/setup.sh            everything the tests use: the test, docs, bench, harness,
#                               distributed and ifeval extras and the client's torch extra
#   scripts/setup.sh --serve    the service, the client and what the examples import
#                               (scripts/serve.sh): under half the size; a later plain run
#                               adds the rest to the same venv
set -euo pipefail
cd "$(dirname "$0")/.."

profile=test
if [ "${1:-}" = "--serve" ]; then
  profile=serve
fi
venv=${RLSERVE_VENV:-.venv}
torch_spec=${RLSERVE_TORCH:-torch==2.13.0}  # what scripts/install.sh installs
stamp="$venv/.rlserve-installed"
wanted="$(cat pyproject.toml clients/python/pyproject.toml scripts/install.sh scripts/install-model.sh app/engine/smollm2.py | sha256sum | cut -c1-16) $torch_spec"

# The stamp is "<inputs> <torch> <profile>": a test venv serves too.
if [ -f "$stamp" ]; then
  have=$(cat "$stamp")
  if [ "$have" = "$wanted test" ] || [ "$have" = "$wanted $profile" ]; then
    exit 0
  fi
fi
if [ "$profile" = serve ]; then
  scripts/system-deps.sh --serve
  if [ -x "$venv/bin/python" ]; then
    echo "rlserve: updating $venv (the install changed) ..." >&2
  else
    echo "rlserve: building $venv to serve (first run only: torch, transformers and the" \
      "service, about 1.4 GB; a few minutes) ..." >&2
  fi
  scripts/install.sh "$venv" examples --editable
else
  scripts/system-deps.sh
  echo "rlserve: setting up $venv with the test tools (first run: a few minutes) ..." >&2
  scripts/install.sh "$venv" test,examples,bench,docs,harness,distributed,ifeval --editable
fi
PYTHONWARNINGS=ignore::UserWarning "$venv/bin/python" -m pip install --quiet -e "clients/python[torch]"  # (see install.sh)
echo "$wanted $profile" > "$stamp"
