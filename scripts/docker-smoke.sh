#!/usr/bin/env bash
# Build the CPU image and run it with Docker Compose, checking it from outside
# (scripts/docker_smoke.py says what). Uses the running Docker engine; when none answers and
# this runs as root with dockerd installed, starts one for the run and stops it afterwards.
#
#   scripts/docker-smoke.sh [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."

started=""
if ! docker info >/dev/null 2>&1; then
  if [ "$(id -u)" != "0" ] || ! command -v dockerd >/dev/null; then
    echo "docker smoke: no Docker engine answers, and none can be started here" >&2
    exit 2
  fi
  log=$(mktemp)
  dockerd >"$log" 2>&1 &
  started=$!
  trap 'kill "$started" 2>/dev/null; wait "$started" 2>/dev/null || true; rm -f "$log"' EXIT
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    sleep 1
  done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 "$log"; exit 2; } >&2
fi
python=.venv/bin/python
[ -x "$python" ] || python=python3
"$python" scripts/docker_smoke.py "$@"
