#!/usr/bin/env bash
# Trains at T = 65,536 tokens per window on the CPU with the exact adjoint
# (E3): memory stays O(K·T·P + chunk·P·N), where backprop would keep every
# layer's [T, P, N] state. Extra arguments go to `ash train` (e.g. --set optim.steps=2).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
cd "$ASH_ROOT"
mkdir -p build/data
if [ ! -s build/data/fortunes.txt ]; then
  for f in /usr/share/games/fortunes/*; do
    case "$f" in *.dat|*.u8) ;; *) [ -f "$f" ] && cat "$f" ;; esac
  done > build/data/fortunes.txt
fi
rm -rf build/run-long-context
"$ASH_BUILD_DIR/src/ash" train --config examples/configs/long_context.json "$@"
