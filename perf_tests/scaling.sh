#!/usr/bin/env bash
# E4 scaling study (docs/design.md §2, E4): wall time, per-rank peak memory and
# bytes sent per rank for one gradient of a K-layer model at long T, at
# R = 1, 2, 4 layer ranks, for E2 windowed, E3 exact (pipelined) and E3 detached.
#   bash perf_tests/scaling.sh [--T 16384] [--width 128] [--state 16] [--layers 8]
#                              [--ranks "1 2 4"] [--tbar 32] [--ash build/src/ash]
# Prints a markdown table; every row names the command that produced it.
set -euo pipefail
T=16384 P=128 N=16 K=8 RANKS="1 2 4" TBAR=32
ASH="$(cd "$(dirname "$0")/.." && pwd)/build/src/ash"
while [ $# -gt 0 ]; do
  case "$1" in
    --T) T=$2; shift 2 ;; --width) P=$2; shift 2 ;; --state) N=$2; shift 2 ;; --layers) K=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;; --tbar) TBAR=$2; shift 2 ;; --ash) ASH=$2; shift 2 ;;
    *) echo "scaling.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
source "$(dirname "$0")/mpi_study.sh"
mpi_study_setup "$T"
"$ASH" init --set model.width=$P --set model.state=$N --set model.layers=$K --set data.seq_len=$T \
  --set data.batch=1 --precision float --out "$work/model.h5" > /dev/null
mpi=(mpiexec --oversubscribe)
echo "# K=$K P=$P N=$N V=256, T=$T, batch 1, float; $cores cores; $(date -u +%F)"
echo "| engine | R | wall s | speedup vs R=1 | busy | peak per rank (max) | sent per rank (max) |"
echo "|---|---|---|---|---|---|---|"
for eng in "adjoint --truncate $TBAR" "adjoint-exact" "adjoint-exact --detach-inputs"; do
  base=""
  for R in $RANKS; do
    # shellcheck disable=SC2086
    out=$("${mpi[@]}" -n "$R" "$ASH" grad --checkpoint "$work/model.h5" --tokens "$work/corpus.txt" \
          --out "$work/g.h5" --engine $eng --set dist.layer_ranks=$R)
    secs=$(awk '/^time /{print $2}' <<<"$out")
    [ -z "$base" ] && base=$secs
    mpi_study_memory "$out" "$R"
    busy=$(sed -n 's/.*ranks busy \([0-9]*%\).*/\1/p' <<<"$out")
    [ "$R" = 1 ] && busy="-"
    speed=$(awk -v a="$base" -v b="$secs" 'BEGIN{printf "%.2f", a/b}')
    echo "| ${eng} | $R | $secs | $speed | $busy | $peak | $sent |"
  done
done
echo
echo "command per row: mpiexec --oversubscribe -n R ash grad --checkpoint model.h5 --tokens corpus.txt --out g.h5 --engine ENGINE --set dist.layer_ranks=R"
