#!/usr/bin/env bash
# Builds the docs site and takes headless-Chromium screenshots of the index, a guide and the
# API page, to look at them as a reader would. Usage: bash docs/screenshots.sh [OUT_DIR]
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
shoot api.html api
# The long API page, one module section at a time (a headless shot cannot scroll to an anchor), in
# 1280x1600 tiles: api_<section>_<i>.png.
python - "$SITE" <<'PY'
import re, sys
site = sys.argv[1]
page = open(site + "/api.html", encoding="utf-8").read()
starts = [m.start() for m in re.finditer(r'<section id="(accumulation|module-gradaccum[.\w]*)"', page)]
body_end = page.rindex("</article>")
for i, start in enumerate(starts):
    name = re.match(r'<section id="(?:module-gradaccum\.)?([\w.]+)"', page[start:]).group(1)
    end = starts[i + 1] if i + 1 < len(starts) else body_end
    head = page[:page.index('<section id="api-reference"')]
    with open("%s/_shot_api_%s.html" % (site, name), "w", encoding="utf-8") as handle:
        handle.write(head + page[start:end] + page[body_end:])
PY
for section in "$SITE"/_shot_api_*.html; do
  name=$(basename "$section" .html); name=${name#_shot_}
  shoot "$(basename "$section")" "$name" 1280,16000 >/dev/null
  python - "$OUT/$name.png" <<'PY' || echo "no Pillow: $OUT/$name.png not tiled"
import sys
import numpy as np
from PIL import Image
path = sys.argv[1]
full = Image.open(path)
grey = np.asarray(full.convert("L"))[:, 400:1200]  # Text rows have dark and light pixels; below the page is one colour.
ink = np.where((grey < 200).any(axis=1) & (grey > 240).any(axis=1))[0]
gaps = np.where(np.diff(ink) > 600)[0]  # The footer sits at the window's bottom, after a blank stretch.
height = int(ink[gaps[0]] if len(gaps) else ink.max()) + 40 if len(ink) else full.height
for i, top in enumerate(range(0, height, 1600)):
    full.crop((0, top, full.width, min(top + 1600, height))).save(path[:-4] + "_%d.png" % i)
    print(path[:-4] + "_%d.png" % i)
PY
  rm -f "$OUT/$name.png" "$section"
done
shoot api.html api_narrow 600,1200
