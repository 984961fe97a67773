#!/usr/bin/env bash
# Build a Debian bookworm base image with Python 3.11 from Debian's own packages (debootstrap,
# then `docker import`), for a host that reaches Debian's mirror but no image registry. The
# CPU image builds on it with BASE_IMAGE=rlserve-base:bookworm. Needs root and debootstrap.
#
#   scripts/docker-base.sh [IMAGE]        (default rlserve-base:bookworm; kept if present)
set -euo pipefail

image=${1:-rlserve-base:bookworm}
# The Debian mirror is the one this host's apt uses (scripts/apt-mirror.sh; RLSERVE_APT_MIRROR
# overrides it).
mirror=$("$(dirname "$0")/apt-mirror.sh")
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "base: $image is there already"
  exit 0
fi
command -v debootstrap >/dev/null || {
  echo "base: debootstrap is missing (apt-get install debootstrap)" >&2
  exit 1
}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,bubblewrap,ca-certificates \
  bookworm "$root" "$mirror" >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "base: built $image from $mirror"
