#!/usr/bin/env bash
# ruff (lint and format check) and mypy on the service.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check app tests bench clients examples
.venv/bin/ruff format --check app tests bench clients examples
.venv/bin/mypy
.venv/bin/mypy --strict clients/python/rlserve_client
