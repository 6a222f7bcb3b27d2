#!/usr/bin/env bash
# The perf suite, one command (docs/design.md §6):
#   bash perf_tests/suite.sh [--out DIR] [--max-T LOG2] [--torch-max-T LOG2] [--quick] [--no-torch]
# 1. kernel micro-benchmarks (Google Benchmark, JSON)      -> DIR/kernels.json
# 2. engines across T, float, bench model V=256 P=64 N=16 K=2:
#    the forward alone and E3 to 2^max-T, E1 to 2^16       -> DIR/engines.jsonl
# 3. the PyTorch chunked-scan autograd baseline, 1 and 2 threads,
#    to 2^torch-max-T, with the parameters ash initialises
#    (ash init: the same losses, side by side)             -> DIR/torch.jsonl
# 4. plots: memory and time per token against T            -> DIR/*.png
# Builds with cmake/setup.sh first; PyTorch and matplotlib go into the project
# venv (${ASH_VENV:-~/.cache/adjoint-sharding/venv}) from PyPI when missing.
# --quick: small T and short runs (the ctest smoke version); --no-torch skips step 3.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/perf_tests/figures"
MAXT=20
TMAXT=14
QUICK=0
TORCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --max-T) MAXT="$2"; shift 2 ;;
    --torch-max-T) TMAXT="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --no-torch) TORCH=0; shift ;;
    *) echo "suite.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
ASH_VENV="${ASH_VENV:-$HOME/.cache/adjoint-sharding/venv}"
BUILD="${ASH_BUILD_DIR:-$ROOT/build}"
if [ ! -x "$BUILD/perf_tests/ash_bench_grad" ] || [ ! -x "$BUILD/perf_tests/ash_bench_kernels" ]; then
  ASH_BUILD_DIR="$BUILD" bash "$ROOT/cmake/setup.sh"
fi
need="matplotlib"
[ "$TORCH" = 1 ] && need="torch, matplotlib"
if ! "$ASH_VENV/bin/python" -c "import $need" 2>/dev/null; then
  [ -x "$ASH_VENV/bin/python" ] || python3 -m venv "$ASH_VENV"
  echo "[suite] installing ${need} into $ASH_VENV"
  # shellcheck disable=SC2086
  "$ASH_VENV/bin/pip" install -q --disable-pip-version-check ${need//,/}
fi
PY="$ASH_VENV/bin/python"
mkdir -p "$OUT"
export OPENBLAS_NUM_THREADS=1  # one BLAS thread per process: the comparison is per core

pow2() { local a=$1 b=$2 s=""; for ((e = a; e <= b; e += 2)); do s+="${s:+,}$((1 << e))"; done; echo "$s"; }
if [ "$QUICK" = 1 ]; then
  KFILTER='/(512|1024|16777216)/'; KMIN=0; ET="$(pow2 8 10)"; E1T="$ET"; TT="256"; REPS=1
else
  KFILTER='.'; KMIN=0.5; ET="$(pow2 10 "$MAXT")"; E1T="$(pow2 10 16)"; TT="$(pow2 10 "$TMAXT")"; REPS=3
fi

echo "[suite] $(date -u +%F) on $(nproc) cores: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo "[suite] 1/4 kernel micro-benchmarks"
"$BUILD/perf_tests/ash_bench_kernels" "--benchmark_filter=$KFILTER" "--benchmark_min_time=$KMIN" \
  --benchmark_out="$OUT/kernels.json" --benchmark_out_format=json
echo "[suite] 2/4 engines across T"
"$BUILD/perf_tests/ash_bench_grad" --precision float --engines forward,adjoint-exact --T "$ET" --reps "$REPS" \
  --json "$OUT/engines.jsonl"
"$BUILD/perf_tests/ash_bench_grad" --precision float --engines backprop --T "$E1T" --reps "$REPS" \
  --json "$OUT/e1.jsonl"
cat "$OUT/e1.jsonl" >> "$OUT/engines.jsonl" && rm "$OUT/e1.jsonl"
rm -f "$OUT/torch.jsonl"
if [ "$TORCH" = 1 ]; then
  echo "[suite] 3/4 PyTorch baseline"
  "$BUILD/src/ash" init --precision float --set model.vocab=256 --set model.width=64 --set model.state=16 \
    --set model.layers=2 --out "$OUT/model.h5" >/dev/null
  for th in 1 2; do
    "$PY" "$ROOT/perf_tests/torch_baseline.py" --checkpoint "$OUT/model.h5" --T "$TT" --threads "$th" \
      --reps "$REPS" --json "$OUT/torch.jsonl"
  done
  rm -f "$OUT/model.h5"
else
  echo "[suite] 3/4 PyTorch baseline skipped (--no-torch)"
fi
echo "[suite] 4/4 plots"
"$PY" "$ROOT/perf_tests/plot.py" "$OUT"
