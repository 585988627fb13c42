#!/usr/bin/env bash
# Builds the docs site and takes headless-Chromium screenshots of the index, some guides and
# API pages, to look at them as a reader would. Usage: bash docs/screenshots.sh [OUT_DIR]
# Needs Debian's chromium (apt-get install chromium). Screenshots are not committed.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/_build/shots}
SITE=$(mktemp -d)
PROFILE=$(mktemp -d)
trap 'rm -rf "$SITE" "$PROFILE"' EXIT
mkdir -p "$OUT"
python -m sphinx -n -q -b html docs "$SITE"  # Without -W: shots even while a page warns (the test fails on it).
BROWSER=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$BROWSER" ]; then
  echo "no chromium on this machine: apt-get install chromium" >&2
  exit 2
fi
shoot() {  # shoot PAGE NAME [WIDTH,HEIGHT]
  "$BROWSER" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync --hide-scrollbars \
    --user-data-dir="$PROFILE" --window-size="${3:-1280,1600}" --screenshot="$OUT/$2.png" \
    "file://$SITE/$1" >/dev/null 2>&1
  echo "$OUT/$2.png"
}
shoot index.html index
shoot guides/accumulation.html guide_accumulation
shoot api/index.html api
shoot api/accumulation.html api_accumulation
shoot api/distributed.html api_distributed
shoot guides/add_accumulation.html guide_add_accumulation
shoot guides/add_bert.html guide_add_bert
shoot guides/fashion_mnist.html guide_fashion_mnist
shoot api/accumulation.html api_narrow 600,1200
