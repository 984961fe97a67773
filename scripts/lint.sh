#!/usr/bin/env bash
# ruff (lint and format check) and mypy on the service.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check app tests bench
.venv/bin/ruff format --check app tests bench
.venv/bin/mypy
