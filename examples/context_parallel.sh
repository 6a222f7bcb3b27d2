#!/usr/bin/env bash
# Context parallelism (docs/design.md §2, E4 sequence axis): the exact gradient
# (E3) of the bench model — V = 256, P = 256, N = 16, K = 8, 760,064 parameters,
# float — on ONE window of 2^20 bytes of English text, its tokens split over 4
# MPI ranks (each holds a quarter of every layer's activations). Prints the
# loss, the time and every rank's peak memory.
#   bash examples/context_parallel.sh [--T 1048576] [--ranks 4] [--width 256] [--layers 8]
#                                     [--tokens FILE] [--ash PATH --work DIR]   (--ash: no set-up/build)
# About 18 minutes and 14 GiB in all on the 2-core CI machine at the defaults.
set -euo pipefail
T=1048576 RANKS=4 P=256 K=8 TOKENS="" ASH="" WORK=""
while [ $# -gt 0 ]; do
  case "$1" in
    --T) T=$2; shift 2 ;; --ranks) RANKS=$2; shift 2 ;; --width) P=$2; shift 2 ;; --layers) K=$2; shift 2 ;;
    --tokens) TOKENS=$2; shift 2 ;; --ash) ASH=$2; shift 2 ;; --work) WORK=$2; shift 2 ;;
    *) echo "context_parallel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$ASH" ]; then
  source "$(dirname "${BASH_SOURCE[0]}")/../cmake/setup.sh"
  cd "$ASH_ROOT"
  ASH="$ASH_BUILD_DIR/src/ash"
fi
WORK="${WORK:-build/context-parallel}"
mkdir -p "$WORK"
if [ -z "$TOKENS" ]; then
  TOKENS=build/data/fortunes.txt
  mkdir -p build/data
  if [ ! -s "$TOKENS" ]; then
    for f in /usr/share/games/fortunes/*; do
      case "$f" in *.dat|*.u8) ;; *) [ -f "$f" ] && cat "$f" ;; esac
    done > "$TOKENS"
  fi
fi
"$ASH" init --set model.width="$P" --set model.state=16 --set model.layers="$K" --set data.seq_len="$T" \
  --set data.batch=1 --set grad.engine=adjoint-exact --precision float --out "$WORK/model.h5"
[ "$(id -u)" -eq 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "[context] exact gradient of one window of T=$T tokens over $RANKS sequence ranks"
OPENBLAS_NUM_THREADS=1 mpiexec --oversubscribe -n "$RANKS" "$ASH" grad --checkpoint "$WORK/model.h5" \
  --tokens "$TOKENS" --set dist.seq_ranks="$RANKS" --out "$WORK/grad.h5"
