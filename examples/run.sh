#!/usr/bin/env bash
# The main job: build, then train a byte-level SSM language model on real
# English text (Debian's `fortunes` package) for a few minutes on the CPU with
# the exact adjoint, print progress, the validation bits/byte against the
# uniform and unigram baselines, and a generated sample.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
cd "$ASH_ROOT"
ASH="$ASH_BUILD_DIR/src/ash"
mkdir -p build/data
if [ ! -s build/data/fortunes.txt ]; then
  for f in /usr/share/games/fortunes/*; do
    case "$f" in *.dat|*.u8) ;; *) [ -f "$f" ] && cat "$f" ;; esac
  done > build/data/fortunes.txt
fi
echo "[run] corpus build/data/fortunes.txt: $(wc -c < build/data/fortunes.txt) bytes"
rm -rf build/run-fortunes
"$ASH" train --config examples/configs/fortunes.json "$@"
echo "[run] sample (temperature 0.7):"
"$ASH" generate --checkpoint build/run-fortunes/checkpoint.h5 --prompt "The " --tokens 300 --temperature 0.7 --seed 7
