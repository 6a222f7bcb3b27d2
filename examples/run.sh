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
# Two data-parallel MPI ranks when the machine has two cores or more: Debian's
# Kokkos is Serial, so ranks are how the job uses both cores (measured 2.2x the
# tokens/s of one process on the 2-core CI machine; perf_tests/RESULTS.md, "E4: the main job as two data-parallel ranks").
# ASH_RANKS=1 runs one process.
ranks="${ASH_RANKS:-$(( $(nproc) >= 2 ? 2 : 1 ))}"
if [ "$ranks" -gt 1 ] && command -v mpiexec >/dev/null && grep -q "ASH_ENABLE_MPI:BOOL=ON" "$ASH_BUILD_DIR/CMakeCache.txt"; then
  echo "[run] $ranks data-parallel MPI ranks (ASH_RANKS=1 for one process)"
  [ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  OPENBLAS_NUM_THREADS=1 mpiexec --oversubscribe -n "$ranks" "$ASH" train --config examples/configs/fortunes.json "$@"
else
  "$ASH" train --config examples/configs/fortunes.json "$@"
fi
echo "[run] sample (temperature 0.7):"
"$ASH" generate --checkpoint build/run-fortunes/checkpoint.h5 --prompt "The " --tokens 300 --temperature 0.7 --seed 7
