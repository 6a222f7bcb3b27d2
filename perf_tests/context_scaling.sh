#!/usr/bin/env bash
# Context-parallel scaling (docs/design.md §2, E4 sequence axis): the exact
# gradient (E3) of one window at T = 2^16 .. 2^20 on S = 1, 2, 4 sequence
# ranks: wall time, the largest rank's peak memory and bytes sent per rank.
#   bash perf_tests/context_scaling.sh [--T "65536 262144 1048576"] [--ranks "1 2 4"]
#                                      [--width 64] [--state 16] [--layers 2] [--ash build/src/ash]
# Prints a markdown table; every row names the command that produced it.
set -euo pipefail
TS="65536 262144 1048576" RANKS="1 2 4" P=64 N=16 K=2
ASH="$(cd "$(dirname "$0")/.." && pwd)/build/src/ash"
while [ $# -gt 0 ]; do
  case "$1" in
    --T) TS=$2; shift 2 ;; --ranks) RANKS=$2; shift 2 ;; --width) P=$2; shift 2 ;; --state) N=$2; shift 2 ;;
    --layers) K=$2; shift 2 ;; --ash) ASH=$2; shift 2 ;;
    *) echo "context_scaling.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
maxT=0
for T in $TS; do [ "$T" -gt "$maxT" ] && maxT=$T; done
source "$(dirname "$0")/mpi_study.sh"
mpi_study_setup "$maxT"
echo "# K=$K P=$P N=$N V=256, one window, float, adjoint-exact; $cores cores; $(date -u +%F)"
echo "| T | S | wall s | us/token | peak per rank (max) | sent per rank (max) |"
echo "|---|---|---|---|---|---|"
for T in $TS; do
  "$ASH" init --set model.width=$P --set model.state=$N --set model.layers=$K --set data.seq_len=$T \
    --set data.batch=1 --precision float --out "$work/model.h5" > /dev/null
  for S in $RANKS; do
    out=$(mpiexec --oversubscribe -n "$S" "$ASH" grad --checkpoint "$work/model.h5" --tokens "$work/corpus.txt" \
          --out "$work/g.h5" --engine adjoint-exact --set dist.seq_ranks=$S)
    secs=$(awk '/^time /{print $2}' <<<"$out")
    us=$(sed -n 's/^time .* (\(.*\) us\/token)/\1/p' <<<"$out")
    mpi_study_memory "$out" "$S"
    echo "| $T | $S | $secs | $us | $peak | $sent |"
  done
done
echo
echo "command per row: mpiexec --oversubscribe -n S ash grad --checkpoint model.h5 --tokens corpus.txt --out g.h5 --engine adjoint-exact --set dist.seq_ranks=S"
