#!/usr/bin/env bash
# Issue 20's GPU measurements in one command, for a lent GPU machine's few minutes
# (docs/design.md §6, "On a lent GPU"):
#
#   bash perf_tests/gpu_run.sh --build DIR --out DIR [--python PY]
#        [--mamba-sdist FILE | --mamba-dir DIR] [--skip tests,sanitizer,kernels,engines,matmul,mamba]
#        [--mamba-seconds S] [--quick]
#
# DIR (--build) is a CUDA build of this repository (built elsewhere with nvcc and carried
# with the Kokkos it links). In order, each step under a time limit, logs and JSON in
# --out:
#   1. tests      every GoogleTest binary of the build (the 64 GB index-width test included)
#   2. sanitizer  compute-sanitizer memcheck and racecheck on the changed kernels' tests
#                 (E3's fused per-chunk backward, the RMSNorm teams, the forward)
#   3. kernels    ash_bench_kernels: triad and gemm peaks, forward scan, E3 layer (both forms)
#   4. engines    ash_bench_grad, float: both models (P=64 K=2; P=256 K=8), the forward and
#                 E3 fused and with wave buffers, 2^14 … 2^20 (the small model's fused E3 to 2^24)
#   5. matmul     run.matmul fp32 / tf32 / bf16 at P = 1024, K = 2, T = 2^16
#   6. mamba      perf_tests/mamba_build.sh (from --mamba-sdist, unless --mamba-dir has a
#                 build), then perf_tests/mamba_vs_ash.py within --mamba-seconds per measurement
# A step that fails is reported and the next one runs; the exit status is the number of
# failed steps (0: all passed). --quick: tiny sizes for a host check of the script itself
# (no GPU needed; the sanitizer step is skipped where compute-sanitizer is missing, and the
# mamba step uses mamba-ssm's selective_scan_ref, as ctest mamba_vs_ash_smoke).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BUILD="" OUT="" PY=python3 SDIST="" MDIR="" SKIP="" MSEC=60 QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --build) BUILD=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --mamba-sdist) SDIST=$2; shift 2 ;;
    --mamba-dir) MDIR=$2; shift 2 ;;
    --skip) SKIP=$2; shift 2 ;;
    --mamba-seconds) MSEC=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "gpu_run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$BUILD" ] && [ -n "$OUT" ] || { echo "gpu_run.sh: --build DIR and --out DIR are required" >&2; exit 2; }
[ -x "$BUILD/perf_tests/ash_bench_grad" ] || { echo "gpu_run.sh: no $BUILD/perf_tests/ash_bench_grad" >&2; exit 2; }
BUILD="$(cd "$BUILD" && pwd)"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
failed=0
skipped() { [[ ",$SKIP," == *",$1,"* ]]; }
# step NAME SECONDS CMD...: runs CMD under a time limit into OUT/NAME.log.
step() {
  local name=$1 limit=$2
  shift 2
  echo "[gpu_run] $(date -u +%T) $name: $*" | tee -a "$OUT/steps.log"
  local t0=$SECONDS rc=0
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1 || rc=$?
  echo "[gpu_run] $(date -u +%T) $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  return 0
}
pow2() { local a=$1 b=$2 s=""; for ((e = a; e <= b; e += 2)); do s+="${s:+,}$((1 << e))"; done; echo "$s"; }

{
  echo "date: $(date -u +%FT%TZ)"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
  echo "build: $BUILD"
  (command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader) || echo "gpu: none (nvidia-smi not found)"
  echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
} | tee "$OUT/machine.txt"

if [ "$QUICK" = 1 ]; then
  ET="256,1024" ET_SMALL="256,1024" BIG_T=1024 REPS=1 KFILTER='/(1024|16777216)(/|$)' KMIN=0
  MODEL_BIG=(--width 32 --state 8 --layers 3) MATMUL_DIMS=(--width 64 --state 8 --layers 2) MATMUL_T=512
  TESTS=("test_adjoint_exact:AdjointExact.Fused*:AdjointExact.Deterministic" "test_matmul:*")
else
  ET="$(pow2 14 20)" ET_SMALL="$(pow2 14 24)" BIG_T=1048576 REPS=3 KFILTER='.' KMIN=0.5
  MODEL_BIG=(--width 256 --state 16 --layers 8) MATMUL_DIMS=(--width 1024 --state 16 --layers 2) MATMUL_T=65536
  TESTS=()  # binary:gtest filter
  for t in "$BUILD"/unit_tests/test_*; do [ -x "$t" ] && TESTS+=("$(basename "$t"):*"); done
fi

if ! skipped tests; then
  for tf in "${TESTS[@]}"; do
    step "tests_${tf%%:*}" 900 "$BUILD/unit_tests/${tf%%:*}" "--gtest_filter=${tf#*:}" --gtest_brief=1
  done
fi

if ! skipped sanitizer; then
  if command -v compute-sanitizer >/dev/null; then
    # The kernels issue 20 changed: E3's fused per-chunk backward (both h forms, channel
    # blocks), the RMSNorm teams and the forward. racecheck is slow: the smallest tests.
    step sanitizer_memcheck 900 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 1 \
      "$BUILD/unit_tests/test_adjoint_exact" '--gtest_filter=AdjointExact.Fused*:AdjointExact.Deterministic:AdjointExact.Detached*'
    step sanitizer_memcheck_forward 600 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 1 \
      "$BUILD/unit_tests/test_forward"
    step sanitizer_racecheck 900 compute-sanitizer --tool racecheck --error-exitcode 1 \
      "$BUILD/unit_tests/test_adjoint_exact" '--gtest_filter=AdjointExact.Fused*:AdjointExact.Deterministic'
  else
    echo "[gpu_run] sanitizer: compute-sanitizer not found, skipped" | tee -a "$OUT/steps.log"
  fi
fi

if ! skipped kernels; then
  step kernels 900 "$BUILD/perf_tests/ash_bench_kernels" "--benchmark_filter=$KFILTER" "--benchmark_min_time=$KMIN" \
    --benchmark_out="$OUT/kernels.json" --benchmark_out_format=json
fi

if ! skipped engines; then
  G="$BUILD/perf_tests/ash_bench_grad"
  step engines_small 1200 "$G" --precision float --engines forward,adjoint-exact --e3-form fused --T "$ET_SMALL" \
    --reps "$REPS" --json "$OUT/engines_small_fused.jsonl"
  step engines_small_waves 900 "$G" --precision float --engines adjoint-exact --e3-form waves --T "$ET" \
    --reps "$REPS" --json "$OUT/engines_small_waves.jsonl"
  step engines_bench 1200 "$G" --precision float --engines forward,adjoint-exact --e3-form fused --T "$ET" \
    --reps "$REPS" "${MODEL_BIG[@]}" --json "$OUT/engines_bench_fused.jsonl"
  step engines_bench_waves 900 "$G" --precision float --engines adjoint-exact --e3-form waves --T "$BIG_T" \
    --reps "$REPS" "${MODEL_BIG[@]}" --json "$OUT/engines_bench_waves.jsonl"
  step engines_profile 600 "$G" --precision float --engines forward,adjoint-exact --T "$BIG_T" --reps 2 \
    "${MODEL_BIG[@]}" --profile
fi

if ! skipped matmul; then
  for m in fp32 tf32 bf16; do
    step "matmul_$m" 600 "$BUILD/perf_tests/ash_bench_grad" --precision float --engines forward,adjoint-exact \
      --T "$MATMUL_T" --reps "$REPS" "${MATMUL_DIMS[@]}" --matmul "$m" --json "$OUT/matmul_$m.jsonl"
  done
fi

if ! skipped mamba; then
  if [ "$QUICK" = 1 ]; then
    step mamba 600 "$PY" "$ROOT/perf_tests/mamba_vs_ash.py" --quick --out "$OUT/mamba" --python "$PY" --build "$BUILD"
  else
    if [ -z "$MDIR" ] && [ -n "$SDIST" ]; then
      MDIR="$OUT/mamba_build"
      step mamba_build 1500 bash "$ROOT/perf_tests/mamba_build.sh" --sdist "$SDIST" --out "$MDIR" --python "$PY" \
        --jobs "$(nproc)"
    fi
    if [ -n "$MDIR" ] && ls "$MDIR"/selective_scan_cuda*.so >/dev/null 2>&1; then
      step mamba 3600 "$PY" "$ROOT/perf_tests/mamba_vs_ash.py" --out "$OUT/mamba" --python "$PY" --mamba-dir "$MDIR" \
        --build "$BUILD" --max-seconds "$MSEC"
    else
      echo "[gpu_run] mamba: no selective_scan_cuda build (--mamba-sdist or --mamba-dir), skipped" |
        tee -a "$OUT/steps.log"
    fi
  fi
fi

echo "[gpu_run] $failed step(s) failed; logs in $OUT" | tee -a "$OUT/steps.log"
exit "$failed"
