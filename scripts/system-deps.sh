#!/usr/bin/env bash
# Debian packages the server uses: bubblewrap isolates the python tool. Installed when missing
# and this runs as root with apt-get; otherwise it says what to install and carries on (the
# python tool then refuses to run, and says why).
set -euo pipefail

if command -v bwrap >/dev/null; then
  exit 0
fi
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends bubblewrap >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends bubblewrap >/dev/null; }
else
  echo "note: install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) for the python tool" >&2
fi
