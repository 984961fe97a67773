#!/usr/bin/env bash
# What scripts/docker-smoke.sh needs, from Debian's packages only (image registries may be
# out of reach): the Docker engine (docker.io), debootstrap for a local base image, and
# Docker Compose v2 (the `docker compose` plugin). Bookworm ships only Compose v1, which
# cannot pass `systempaths=unconfined`, so the plugin comes from Debian 13's package: its
# checksum is checked against that release's signed index, and only the plugin's binary is
# installed (it needs libc6 >= 2.34; bookworm has 2.36). Root only; does nothing when all is
# there already.
set -euo pipefail

plugins=/usr/local/libexec/docker/cli-plugins
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null; }
fi
if docker compose version >/dev/null 2>&1; then
  exit 0
fi
# The Debian mirror is the one this host's apt uses (scripts/apt-mirror.sh; RLSERVE_APT_MIRROR
# overrides it).
mirror=$("$(dirname "$0")/apt-mirror.sh")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The index is trusted the way apt trusts it: InRelease is signed by Debian's archive key.
curl -fsSL "$mirror/dists/trixie/InRelease" -o "$work/InRelease"
gpgv --keyring /usr/share/keyrings/debian-archive-keyring.gpg "$work/InRelease" 2>/dev/null \
  || { echo "docker-deps: trixie's InRelease does not verify" >&2; exit 1; }
index_sum=$(awk '/^SHA256:/{f=1;next} /^[A-Z]/{f=0} f && $3=="main/binary-amd64/Packages.xz"{print $1}' "$work/InRelease")
curl -fsSL "$mirror/dists/trixie/main/binary-amd64/Packages.xz" -o "$work/Packages.xz"
echo "$index_sum  $work/Packages.xz" | sha256sum --check --quiet
entry=$(xz -dc "$work/Packages.xz" | awk '/^Package: docker-compose$/,/^$/')
file=$(echo "$entry" | awk '/^Filename:/{print $2}')
sum=$(echo "$entry" | awk '/^SHA256:/{print $2}')
curl -fsSL "$mirror/$file" -o "$work/compose.deb"
echo "$sum  $work/compose.deb" | sha256sum --check --quiet
dpkg-deb -x "$work/compose.deb" "$work/root"
install -D -m 0755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" "$plugins/docker-compose"
echo "docker-deps: $(docker compose version) (from Debian: $file)"
