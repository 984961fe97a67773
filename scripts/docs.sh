#!/usr/bin/env bash
# Build the docs site (MkDocs, Material theme) into build/site, strictly: a warning (a broken
# link or anchor, a page missing from the nav) fails the build. `--serve` previews it on
# http://127.0.0.1:8010 instead, rebuilding on each edit. CI builds it in tests/docs/test_site.py.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
export NO_MKDOCS_2_WARNING=1  # the theme's notice about its successor, printed on every build
if [ "${1:-}" = "--serve" ]; then
  exec .venv/bin/mkdocs serve --strict --dev-addr 127.0.0.1:8010
fi
exec .venv/bin/mkdocs build --strict
