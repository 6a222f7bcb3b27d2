#!/usr/bin/env bash
# The main job: build, write a seeded model, and compute its loss and full
# gradient on real English text (the GPL-3 text every Debian system ships).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
ASH="$ASH_BUILD_DIR/src/ash"
OUT="$ASH_BUILD_DIR/quickstart"
TEXT="${ASH_TEXT:-/usr/share/common-licenses/GPL-3}"
mkdir -p "$OUT"
"$ASH" init --config "$ASH_ROOT/examples/configs/small.json" --out "$OUT/model.h5"
"$ASH" inspect "$OUT/model.h5" | head -4
"$ASH" grad --checkpoint "$OUT/model.h5" --tokens "$TEXT" --engine backprop --out "$OUT/grads.h5"
echo "gradients in $OUT/grads.h5 (datasets /loss and /grad/...)"
