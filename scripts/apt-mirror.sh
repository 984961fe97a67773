#!/usr/bin/env bash
# Print the Debian mirror this host's apt already uses, for the image scripts (docker-base.sh,
# docker-deps.sh): a site behind its own mirror, or offline with a local one, needs no setting,
# and no host name is written into the project. RLSERVE_APT_MIRROR overrides it (DEBIAN_MIRROR,
# the older name, too).
#
# The mirror is the first enabled `deb` source for Debian's main archive: a Debian release suite
# (bookworm, trixie, stable, ...; not -security, -updates or a third party's) with `main`, read
# from the deb822 files (/etc/apt/sources.list.d/*.sources), then the one-line lists
# (/etc/apt/sources.list, /etc/apt/sources.list.d/*.list).
#
#   scripts/apt-mirror.sh [APT_DIR]     (default /etc/apt; a test points it elsewhere)
set -euo pipefail

if [ -n "${RLSERVE_APT_MIRROR:-${DEBIAN_MIRROR:-}}" ]; then
  echo "${RLSERVE_APT_MIRROR:-$DEBIAN_MIRROR}"
  exit 0
fi
apt_dir=${1:-/etc/apt}
shopt -s nullglob
sources=()
for file in "$apt_dir"/sources.list.d/*.sources "$apt_dir"/sources.list "$apt_dir"/sources.list.d/*.list; do
  [ -r "$file" ] && sources+=("$file")
done
[ ${#sources[@]} -gt 0 ] || sources=(/dev/null)

found=$(awk '
  function release(suites,   n, i, s) {
    n = split(suites, s, " ")
    for (i = 1; i <= n; i++) if (s[i] ~ /^(buster|bullseye|bookworm|trixie|forky|duke|sid|(old)*stable|testing|unstable)$/) return 1
    return 0
  }
  function main_component(components,   n, i, c) {
    n = split(components, c, " ")
    for (i = 1; i <= n; i++) if (c[i] == "main") return 1
    return 0
  }
  function usable(uri) { return uri ~ /^(https?|ftp|file):\/\// }
  function stanza_end() {
    if (types ~ /(^| )deb( |$)/ && enabled != "no" && release(suites) && main_component(components)) {
      split(uris, u, " ")
      if (usable(u[1])) { print u[1]; exit }
    }
    types = uris = suites = components = ""; enabled = "yes"
  }
  FNR == 1 { if (NR > 1 && deb822) stanza_end(); deb822 = (FILENAME ~ /\.sources$/); enabled = "yes" }
  deb822 && /^[[:space:]]*#/ { next }
  deb822 && /^[[:space:]]*$/ { stanza_end(); next }
  deb822 && /^[[:space:]]/ { next }  # continuation line of a field (an inline key)
  deb822 {
    key = tolower($1); sub(/:$/, "", key); $1 = ""; sub(/^ +/, "")
    if (key == "types") types = $0
    else if (key == "uris") uris = $0
    else if (key == "suites") suites = $0
    else if (key == "components") components = $0
    else if (key == "enabled") enabled = tolower($0)
    next
  }
  # One-line format: deb [options] URI SUITE COMPONENT...
  /^[[:space:]]*deb[[:space:]]/ {
    line = $0; sub(/\[[^]]*\]/, "", line); n = split(line, f, " ")
    rest = ""; for (i = 4; i <= n; i++) rest = rest " " f[i]
    if (n >= 4 && release(f[3]) && main_component(rest) && usable(f[2])) { print f[2]; exit }
  }
  END { if (deb822) stanza_end() }
' "${sources[@]}" | head -n 1)

if [ -z "$found" ]; then
  echo "apt-mirror: no Debian main archive among the apt sources in $apt_dir;" \
    "set RLSERVE_APT_MIRROR to a mirror (e.g. http://<host>/debian)" >&2
  exit 1
fi
echo "${found%/}"
