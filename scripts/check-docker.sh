#!/usr/bin/env bash
# Validate the container setup without a Docker engine: hadolint on both Dockerfiles, and
# `docker-compose config` (v1.29, which validates against the compose schema offline) on
# docker-compose.yml with .env.example, for the default (GPU) service and the cpu and ray profiles.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/hadolint --failure-threshold info docker/Dockerfile docker/Dockerfile.cpu

# docker-compose 1.29 pins PyYAML<6, which no longer builds; it runs fine on PyYAML 6.
venv=.venv-compose
if [ ! -x "$venv/bin/docker-compose" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --no-deps docker-compose==1.29.2
  "$venv/bin/python" -m pip install --quiet "PyYAML>=6" docopt==0.6.2 "jsonschema>=3.2,<4" \
    "python-dotenv>=0.13" "requests>=2.20,<2.32" "texttable>=0.9" "websocket-client<1" \
    "docker>=5,<7" "dockerpty>=0.4.1" "distro>=1.5"
fi
export RLSERVE_ENV_FILE=.env.example  # the file the containers' settings come from
compose=("$venv/bin/docker-compose" --env-file .env.example -f docker-compose.yml)
"${compose[@]}" config --quiet
"${compose[@]}" --profile cpu config --quiet
"${compose[@]}" --profile ray config --quiet
services="$("${compose[@]}" config --services | sort | tr '\n' ' ')"
test "$services" = "redis rlserve rlserve-cpu rlserve-ray " || { echo "services: $services"; exit 1; }
echo "docker: Dockerfiles lint clean, compose file valid"
