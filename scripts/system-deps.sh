#!/usr/bin/env bash
# Debian packages the server and its tests use: bubblewrap isolates the python tool, and
# redis-server is the shared session store the multi-server tests start; wrk is the load
# generator of bench/overhead.py (which falls back to Python's httpx without it). Installed when
# missing and this runs as root with apt-get; otherwise it says what to install and carries
# on (the python tool then refuses to run and says why; the Redis tests skip and say why).
# With --serve only what serving uses: bubblewrap.
set -euo pipefail

missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
if [ "${1:-}" != "--serve" ]; then
  command -v redis-server >/dev/null || missing+=(redis-server)
  command -v wrk >/dev/null || missing+=(wrk)
fi
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
else
  echo "note: install ${missing[*]} (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
fi
