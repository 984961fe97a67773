#!/usr/bin/env bash
# ruff (lint and format check) and mypy on the service and the client (the client as strictly
# as --strict: pyproject.toml's overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check app tests bench clients examples
.venv/bin/ruff format --check app tests bench clients examples
.venv/bin/mypy
