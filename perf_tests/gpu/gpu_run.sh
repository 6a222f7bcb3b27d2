#!/usr/bin/env bash
# The GPU measurements, in stages that each fit one command of a lent GPU machine
# (perf_tests/gpu/README.md, the runbook):
#
#   bash perf_tests/gpu/gpu_run.sh --bundle build-gpu/bundle.tar.xz --stage A --out $OUT --budget 480
#        [--from STEP] [--python PY] [--quick --build DIR]
#
# --bundle: perf_tests/gpu/bundle.sh's packed bundle (unpacked into a temporary folder) or
# its folder. --stage: A, B or C, or several (ABC). --budget: seconds for the whole call,
# packing included; every step runs under min(its cap, what is left) and a step that no
# longer fits is not started: it is listed as not run, and the next window starts there
# with --from STEP. One line per step with its time; results as JSON lines.
#
#   A  correctness and the headline: the bench model's gradient at 2^20 as it is (fused E3
#      with its default waves, --wave 4096 (the waves before e3_fused_waves), --chunk 32, a
#      kernel profile), the GoogleTest binaries of the library
#      (not the 64 GB index-width test, MPI or the CLI-heavy ones), compute-sanitizer
#      memcheck on the fused E3 and forward tests, then E3 against mamba-ssm (mamba's
#      extension linked here first).
#   B  scale: our Mamba (D=256 N=16 K=4, E3) against mamba-ssm's Mamba blocks (checked,
#      then T=2^12 upward to out of memory; mamba's extension linked first unless an earlier
#      call on this machine linked it), then our Mamba-2 (D=256 N=64 head_dim=64 K=4) against
#      mamba-ssm's Mamba2 blocks (its Triton SSD) the same way; the longest T that the planner fits, then one
#      gradient at it; run.matmul fp32/tf32/bf16 at P=1024; MPI with 2 ranks on the GPU
#      (CUDA-aware detected, never assumed); the 1.36 B model (P=4096 N=16 K=80 V=256) at
#      T=100K with E3, bf16 storage and layer checkpointing, 3 AdamW steps; last, SSMStack on
#      CUDA tensors: the Python module built there from the bundle's sdk/ (b_ssmstack_build),
#      then checked against PyTorch autograd and timed beside it (perf_tests/gpu/ssmstack_cuda.py).
#   C  the rest: the CLI-heavy test binaries (train, cli, reliability), the 64 GB
#      index-width test, racecheck, longer sweeps, kernel benchmarks.
#
# --out receives at most 8 files: summary.md, steps.jsonl, machine.txt and results.tar.gz
# (every log and JSON file of the steps). Exit status: the number of failed steps.
# mamba's linked extension is kept for later calls on the same machine in
# $ASH_GPU_CACHE (default: /tmp/ash-gpu-cache), keyed by the bundle's mamba build, the
# Python and the torch, so stage B after stage A does not link it again.
# --quick --build DIR: a host dry run of the script itself at tiny sizes from a host build
# (ctest gpu_run_smoke); steps whose tool is missing here are skipped with the reason.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BUNDLE="" STAGES="" OUT="" BUDGET=480 FROM="" PY=python3 QUICK=0 BUILD=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bundle) BUNDLE=$2; shift 2 ;;
    --stage) STAGES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --budget) BUDGET=$2; shift 2 ;;
    --from) FROM=$2; shift 2 ;;
    --python) PY=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --build) BUILD=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_run.sh: unknown argument $1 (--help)" >&2; exit 2 ;;
  esac
done
[ -n "$OUT" ] && [ -n "$STAGES" ] || { echo "gpu_run.sh: --stage A|B|C and --out DIR are required" >&2; exit 2; }
[[ "$STAGES" =~ ^[ABC]+$ ]] || { echo "gpu_run.sh: --stage takes A, B, C or several of them (ABC)" >&2; exit 2; }
[[ "$BUDGET" =~ ^[0-9]+$ ]] && [ "$BUDGET" -ge 30 ] || { echo "gpu_run.sh: --budget takes seconds, at least 30" >&2; exit 2; }
if [ "$QUICK" = 1 ]; then
  [ -n "$BUILD" ] && [ -x "$BUILD/src/ash" ] || { echo "gpu_run.sh: --quick needs --build DIR (a host build)" >&2; exit 2; }
else
  [ -n "$BUNDLE" ] && [ -e "$BUNDLE" ] || { echo "gpu_run.sh: --bundle FILE|DIR is required (perf_tests/gpu/bundle.sh)" >&2; exit 2; }
fi
T_START=$SECONDS
RESERVE=20  # seconds kept for the summary and the packing
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WORKDIR="$(mktemp -d "${TMPDIR:-/tmp}/ash-gpu-run.XXXXXX")"
RES="$WORKDIR/results"
mkdir -p "$RES" "$WORKDIR/tmp"
export TEST_TMPDIR="$WORKDIR/tmp/"
say() { echo "[gpu_run] $*" | tee -a "$RES/steps.log"; }

# --- the binaries: the bundle's, or a host build's (--quick) ---------------------------------
if [ "$QUICK" = 1 ]; then
  BUILD="$(cd "$BUILD" && pwd)"
  B="$WORKDIR/bundle"
  mkdir -p "$B/bin" "$B/lib"
  ln -s "$BUILD/src/ash" "$B/bin/ash"
  for f in "$BUILD"/perf_tests/ash_bench_* "$BUILD"/unit_tests/test_*; do [ -x "$f" ] && [ -f "$f" ] && ln -s "$f" "$B/bin/"; done
  MPIEXEC="$(command -v mpiexec || true)"
else
  if [ -d "$BUNDLE" ]; then
    B="$(cd "$BUNDLE" && pwd)"
  else
    say "unpacking $BUNDLE"
    t0=$SECONDS
    tar -xJf "$BUNDLE" -C "$WORKDIR" 2>/dev/null || "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$BUNDLE" "$WORKDIR" ||
      { echo "gpu_run.sh: cannot unpack $BUNDLE" >&2; exit 2; }
    B="$(find "$WORKDIR" -mindepth 2 -maxdepth 2 -name BUNDLE_INFO.json -printf '%h\n' | head -1)"
    [ -n "$B" ] || { echo "gpu_run.sh: $BUNDLE holds no BUNDLE_INFO.json" >&2; exit 2; }
    say "unpacked in $((SECONDS - t0)) s"
  fi
  # cuBLAS and the CUDA runtime are the GPU machine's own (bundle.sh's PROVIDED): where the
  # loader does not know them, the folder of torch's own (its nvidia wheels) comes first.
  # The bundle's libraries need no LD_LIBRARY_PATH (the binaries' RPATH names them).
  cuda_dirs=""
  for lib in libcublas.so.13 libcublasLt.so.13 libcudart.so.13; do
    ldconfig -p 2>/dev/null | grep -q "$lib" && continue
    d="$( { "$PY" -c "import nvidia, sys; print('\n'.join(nvidia.__path__))" 2>/dev/null;
            ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/lib64 2>/dev/null; } |
          while read -r base; do find "$base" -maxdepth 4 -name "$lib" -printf '%h\n' 2>/dev/null; done | head -1)"
    [ -n "$d" ] && [[ ":$cuda_dirs:" != *":$d:"* ]] && cuda_dirs="$cuda_dirs:$d"
  done
  [ -n "$cuda_dirs" ] && export LD_LIBRARY_PATH="${cuda_dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX="$B/openmpi" PRTE_PREFIX="$B/openmpi" PMIX_PREFIX="$B/openmpi"
  export PATH="$B/openmpi/bin:$PATH"
  MPIEXEC="$B/openmpi/bin/mpiexec"
fi
export ASH_CLI="$B/bin/ash"
export ASH_MPIEXEC="env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ${MPIEXEC:-mpiexec} --oversubscribe"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ASH="$B/bin/ash" G="$B/bin/ash_bench_grad" KB="$B/bin/ash_bench_kernels"

{
  echo "date: $(date -u +%FT%TZ)"
  echo "stage: $STAGES, budget $BUDGET s${FROM:+, from $FROM}$([ "$QUICK" = 1 ] && echo ', --quick (host dry run)')"
  echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "not a git checkout")"
  [ -f "$B/BUNDLE_INFO.json" ] && echo "bundle: $(tr -d '\n' < "$B/BUNDLE_INFO.json" | tr -s ' ')"
  (command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm \
    --format=csv,noheader) || echo "gpu: none (nvidia-smi not found)"
  echo "cpu: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "python: $("$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)' 2>/dev/null || echo "$PY (no torch)")"
  echo "LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-}"
} > "$RES/machine.txt"
cat "$RES/machine.txt"

# --- steps ------------------------------------------------------------------------------------
FAILED=0 REACHED=1 NOT_RUN=()
[ -n "$FROM" ] && REACHED=0
json_str() { printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g' | tr '\n\t' '  '; }
record() {  # record NAME STATUS SECONDS LIMIT RC NOTE
  printf '{"stage":"%s","step":"%s","status":"%s","seconds":%s,"limit":%s,"rc":%s,"note":"%s"}\n' \
    "$STAGE" "$1" "$2" "$3" "$4" "$5" "$(json_str "$6")" >> "$RES/steps.jsonl"
}
# step NAME CAP CMD...: CMD under min(CAP, the budget left) into RES/NAME.log.
step() {
  local name=$1 cap=$2 t0 rc=0 st
  shift 2
  [ "$REACHED" = 1 ] || [ "$name" = "$FROM" ] || { record "$name" before_from 0 0 0 "before --from $FROM"; return 0; }
  REACHED=1
  local left=$((BUDGET - RESERVE - (SECONDS - T_START)))
  if [ "$left" -lt 15 ] || { [ "$left" -lt "$cap" ] && [ "$left" -lt $((cap / 3)) ]; }; then
    NOT_RUN+=("$name"); record "$name" not_run 0 0 0 "budget: ${left} s left"
    say "$(printf '%-3s %-28s not run (%s s of the budget left)' "$STAGE" "$name" "$left")"
    return 0
  fi
  local limit=$((cap < left ? cap : left))
  t0=$SECONDS
  echo "\$ $*" > "$RES/$name.log"
  timeout --signal=TERM --kill-after=5 "$limit" "$@" >> "$RES/$name.log" 2>&1 || rc=$?
  local dt=$((SECONDS - t0))
  case $rc in
    0) st=passed ;;
    77) st=skipped ;;
    124|137) st=timeout; FAILED=$((FAILED + 1)) ;;
    *) st=failed; FAILED=$((FAILED + 1)) ;;
  esac
  local note=""
  [ "$st" = passed ] || note="$(grep -v '^\$ ' "$RES/$name.log" | tail -3 | tr '\n' ' ' | cut -c1-300)"
  record "$name" "$st" "$dt" "$limit" "$rc" "$note"
  say "$(printf '%-3s %-28s %-8s %4d s (limit %d s)%s' "$STAGE" "$name" "$st" "$dt" "$limit" "${note:+  $note}")"
  return 0
}
skip() {  # skip NAME REASON
  [ "$REACHED" = 1 ] || [ "$1" = "$FROM" ] || { record "$1" before_from 0 0 0 "before --from $FROM"; return 0; }
  REACHED=1
  record "$1" skipped 0 0 0 "$2"; say "$(printf '%-3s %-28s skipped: %s' "$STAGE" "$1" "$2")"
}
have_mamba_py() { "$PY" -c "import torch, einops, importlib.util as u; assert u.find_spec('mamba_ssm')" 2>/dev/null; }

# mamba_ready LINK_STEP "USER_STEP...": sets MDIR to the folder with mamba's linked extension
# (empty on the host: --quick uses the interpreter's mamba_ssm sources). The link runs as
# step LINK_STEP, or not at all where an earlier call on this machine left it in the cache.
# It is the USER_STEPs' prerequisite: with --from one of them it runs although it comes earlier.
# Returns 1, having skipped the USER_STEPs with the reason, where there is no mamba-ssm.
MDIR=""
is_from() { [ -n "$FROM" ] && [[ " $1 " == *" $FROM "* ]]; }  # is_from "STEP...": --from names one
mamba_ready() {
  local link=$1 user=$2 key
  MDIR=""
  if [ "$QUICK" = 1 ]; then
    have_mamba_py || { for u in $user; do skip "$u" "torch, einops or mamba_ssm missing for $PY"; done; return 1; }
    return 0
  fi
  [ -d "$B/mamba" ] || { skip "$link" "the bundle has no mamba/ (bundle.sh --no-mamba)"
    for u in $user; do skip "$u" "no mamba-ssm"; done; return 1; }
  key="$( { cat "$B/mamba/BUILD_INFO.json"; "$PY" -c 'import sys, torch; print(sys.version, torch.__version__)' 2>&1; } |
          sha256sum | cut -c1-16)"
  MDIR="${ASH_GPU_CACHE:-/tmp/ash-gpu-cache}/mamba-$key"
  if [ -f "$MDIR/.linked" ] && ls "$MDIR"/selective_scan_cuda*.so >/dev/null 2>&1; then
    [ "$REACHED" = 1 ] || is_from "$user" || { record "$link" before_from 0 0 0 "before --from $FROM"; return 0; }
    record "$link" passed 0 0 0 "linked by an earlier call on this machine: $MDIR"
    say "$(printf '%-3s %-28s cached   (%s)' "$STAGE" "$link" "$MDIR")"
    return 0
  fi
  local reached=$REACHED
  is_from "$user" && REACHED=1  # the prerequisite of the step to start from
  rm -rf "$MDIR"
  step "$link" 120 "$PY" "$ROOT/perf_tests/gpu/mamba_link.py" --bundle-mamba "$B/mamba" --out "$MDIR"
  [ "$reached" = 1 ] || ! is_from "$user" || REACHED=0  # the user step itself opens the --from range
  local last; last="$(tail -1 "$RES/steps.jsonl")"
  if [[ "$last" == *'"status":"not_run"'* ]]; then  # no time for the link: none for its user either
    for u in $user; do
      NOT_RUN+=("$u"); record "$u" not_run 0 0 0 "budget: $link did not run"
      say "$(printf '%-3s %-28s not run (%s did not run)' "$STAGE" "$u" "$link")"
    done
    return 1
  fi
  if ls "$MDIR"/selective_scan_cuda*.so >/dev/null 2>&1 && [[ "$last" == *'"status":"passed"'* ]]; then
    touch "$MDIR/.linked"
  fi
  [ -f "$MDIR/.linked" ] && return 0
  for u in $user; do skip "$u" "mamba's extension was not linked (or failed its check: $link)"; done
  return 1
}

# --- sizes --------------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then
  BENCH=(--width 32 --state 8 --layers 3 --vocab 256) BENCH_T=1024 REPS=1 LONGEST_MAX=16384
  BIG=(model.width=64 model.state=8 model.layers=2 model.vocab=256) BIG_T=512
  MM=(--width 64 --state 8 --layers 2) MM_T=512
  SMALL_T="256,1024" CAP_TEST=120 CAP_BENCH=60
  MPI_FILTER="Distributed.ExactAdjointPipelineMatchesOneProcess" MPI_CLI_FILTER="DistributedCli.GradMatchesOneProcess*"
  CLI_TEST_FILTERS=("test_cli:Cli.EvalScoresEachDocument")
  TEST_FILTERS=("test_adjoint_exact:AdjointExact.Fused*:AdjointExact.Deterministic" "test_matmul:*")
  MAMBA_ARGS=(--quick)
  MAMBA_BLOCK_ARGS=(--quick)
  MAMBA2_ARGS=(--quick)
  MAMBA_E3=(--arch mamba --width 32 --state 8 --layers 2 --vocab 256) MAMBA_E3_T=512
else
  BENCH=(--width 256 --state 16 --layers 8 --vocab 256) BENCH_T=1048576 REPS=2 LONGEST_MAX=1073741824
  MAMBA_E3=(--arch mamba --width 256 --state 16 --layers 4 --vocab 256) MAMBA_E3_T=65536
  BIG=(model.width=4096 model.state=16 model.layers=80 model.vocab=256) BIG_T=100000
  MM=(--width 1024 --state 16 --layers 2) MM_T=65536
  SMALL_T="16384,65536,262144,1048576,4194304,16777216" CAP_TEST=90 CAP_BENCH=75
  MPI_FILTER="*" MPI_CLI_FILTER="*"
  TEST_FILTERS=() CLI_TEST_FILTERS=()
  # most telling first: the fused backward, the forward, cuBLAS, the levers, the planner
  for t in test_adjoint_exact test_forward test_matmul test_mamba_forward test_mamba_engines test_mamba_carry \
           test_mamba_plan test_mamba_generate test_mamba_model test_low_memory test_memory_plan test_backprop \
           test_adjoint test_stack_adjoint test_documents test_memory test_config test_tokens test_dataset \
           test_optimizer test_checkpoint; do
    [ -x "$B/bin/$t" ] && TEST_FILTERS+=("$t:*")
  done
  # the CLI-heavy binaries (hundreds of ash processes, each starting CUDA): stage C
  for t in test_train test_cli test_reliability_limits test_reliability_config test_reliability_checkpoint \
           test_reliability_format test_reliability_paths test_reliability_runs; do
    [ -x "$B/bin/$t" ] && CLI_TEST_FILTERS+=("$t:*")
  done
  MAMBA_ARGS=(--widths 64,256 --layers 2,8 --batch8-T 16384 --max-seconds 20 --reps 2
              --T 4096,8192,16384,32768,65536,131072,262144,524288,1048576,2097152,4194304,8388608,16777216)
  # issue 34's GPU line: the Mamba of D=256 N=16 K=4 (V=256, E=512) at batch 1, T=2^12 upward
  MAMBA_BLOCK_ARGS=(--width 256 --state 16 --layers 4 --vocab 256 --reps 3 --max-seconds 20 --check-T 2048
                    --T 4096,8192,16384,32768,65536,131072,262144,524288,1048576,2097152,4194304,8388608)
  # issue 43's: a Mamba-2 of D=256 N=64 head_dim=64 (H=8) K=4, n_groups 1 (mamba-ssm's default), T=2^12 upward
  MAMBA2_ARGS=(--width 256 --state 64 --head-dim 64 --n-groups 1 --layers 4 --vocab 256 --reps 5 --max-seconds 20
               --check-T 2048 --T 4096,8192,16384,32768,65536,131072,262144,524288,1048576,2097152,4194304)
fi

# BENCH as config keys (model.width=... for ash init / plan / grad)
BENCH_SET=()
for ((j = 0; j < ${#BENCH[@]}; j += 2)); do
  case "${BENCH[$j]}" in --width) k=width ;; --state) k=state ;; --layers) k=layers ;; --vocab) k=vocab ;; esac
  BENCH_SET+=("model.$k=${BENCH[$((j + 1))]}")
done

# The faster E3 form of stage A's side-by-side steps (the lower median of the fused form and
# the walk at each chunk length), as ash_bench_grad options for the mamba-ssm comparisons:
# "--e3-form F --chunk C", or nothing when none of them ran.
fastest_e3() {
  python3 - "$RES" <<'PY' 2>/dev/null || true
import glob, json, os, re, sys
best = None
for f in glob.glob(os.path.join(sys.argv[1], "a_e3_*_chunk*.jsonl")):
    m = re.search(r"a_e3_(fused|walk)_chunk(\d+)\.jsonl$", f)
    for line in open(f) if m else []:
        s = json.loads(line).get("seconds")
        if s is not None and (best is None or s < best[0]):
            best = (s, m.group(1), m.group(2))
if best:
    print(f"--e3-form {best[1]} --chunk {best[2]}")
PY
}

stage_A() {
  step a_bench_e3 "$CAP_BENCH" "$G" --precision float --engines forward,adjoint-exact --T "$BENCH_T" --reps "$REPS" --warmup 1 \
    "${BENCH[@]}" --json "$RES/a_bench_e3.jsonl"
  # The reverse walk beside the fused default at each chunk length (the walk's segment),
  # both warm, 5 reps; its correctness first (the walk against the fused form and E1 to
  # 1e-12 / 1e-10 in double).
  step a_walk_test "$CAP_TEST" "$B/bin/test_adjoint_exact" \
    '--gtest_filter=AdjointExact.Walk*:AdjointExact.EqualsBackprop*:AdjointExact.FusedLaunches*' --gtest_brief=1
  local ch form
  for ch in 64 128; do
    for form in fused walk; do
      step "a_e3_${form}_chunk$ch" "$CAP_BENCH" "$G" --precision float --engines adjoint-exact --T "$BENCH_T" \
        --reps 5 --warmup 1 "${BENCH[@]}" --chunk "$ch" --e3-form "$form" --json "$RES/a_e3_${form}_chunk$ch.jsonl"
    done
  done
  # A Mamba's scan core in the three forms (the waves were a Mamba's only form before; the
  # fused one is now a GPU's default), warm, 5 reps each.
  for form in waves fused walk; do
    step "a_mamba_e3_$form" "$CAP_BENCH" "$G" --precision float --engines adjoint-exact --T "$MAMBA_E3_T" \
      --reps 5 --warmup 1 "${MAMBA_E3[@]}" --e3-form "$form" --json "$RES/a_mamba_e3_$form.jsonl"
  done
  step a_bench_e3_wave4096 "$CAP_BENCH" "$G" --precision float --engines adjoint-exact --T "$BENCH_T" --reps "$REPS" \
    --warmup 1 "${BENCH[@]}" --wave 4096 --json "$RES/a_bench_e3_wave4096.jsonl"
  step a_bench_e3_chunk32 "$CAP_BENCH" "$G" --precision float --engines adjoint-exact --T "$BENCH_T" --reps 1 --warmup 1 \
    "${BENCH[@]}" --chunk 32 --json "$RES/a_bench_e3_chunk32.jsonl"
  step a_bench_profile "$CAP_BENCH" "$G" --precision float --engines forward,adjoint-exact --T "$BENCH_T" --reps 1 --warmup 1 \
    "${BENCH[@]}" --profile
  local tf
  for tf in "${TEST_FILTERS[@]}"; do
    step "a_${tf%%:*}" "$CAP_TEST" "$B/bin/${tf%%:*}" "--gtest_filter=${tf#*:}" --gtest_brief=1
  done
  if command -v compute-sanitizer >/dev/null; then
    step a_memcheck_e3_fused 120 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 1 \
      "$B/bin/test_adjoint_exact" '--gtest_filter=AdjointExact.Fused*:AdjointExact.Walk*:AdjointExact.Deterministic'
    step a_memcheck_forward 90 compute-sanitizer --tool memcheck --leak-check no --error-exitcode 1 \
      "$B/bin/test_forward" --gtest_brief=1
  else
    skip a_memcheck_e3_fused "compute-sanitizer not found"
    skip a_memcheck_forward "compute-sanitizer not found"
  fi
  mamba_ready a_mamba_link a_mamba_vs_ash || return 0
  local e3args
  e3args=$(fastest_e3)
  say "a_mamba_vs_ash: our E3 with ${e3args:-the default form}"
  step a_mamba_vs_ash 420 "$PY" "$ROOT/perf_tests/mamba_vs_ash.py" --out "$RES/mamba" --python "$PY" --kernels "$KB" \
    --ash "$ASH" --bench "$G" ${MDIR:+--mamba-dir "$MDIR"} --deadline $((BUDGET - RESERVE - (SECONDS - T_START) - 10)) \
    ${e3args:+--ash-args "$e3args"} "${MAMBA_ARGS[@]}"
}

stage_B() {
  # Issue 34's GPU line first: short (about 2 minutes, the link cached after stage A), so it
  # also fits the tail of a window that stage A took most of; the 1.36 B run needs a call of
  # its own anyway.
  if mamba_ready b_mamba_link "b_mamba_block_vs_ash b_mamba2_vs_ash"; then
    local cap=180 left=$((BUDGET - RESERVE - (SECONDS - T_START)))
    step b_mamba_block_vs_ash "$cap" "$PY" "$ROOT/perf_tests/mamba_block_vs_ash.py" --out "$RES/mamba_block" \
      --ash "$ASH" --bench "$G" ${MDIR:+--mamba-dir "$MDIR"} --deadline $(((cap < left ? cap : left) - 15)) \
      "${MAMBA_BLOCK_ARGS[@]}"
    # issue 43's GPU line: our Mamba-2 against mamba-ssm's Mamba2 blocks (Triton SSD), the same protocol
    cap=180 left=$((BUDGET - RESERVE - (SECONDS - T_START)))
    step b_mamba2_vs_ash "$cap" "$PY" "$ROOT/perf_tests/mamba2_vs_ash.py" --out "$RES/mamba2" \
      --ash "$ASH" --bench "$G" ${MDIR:+--mamba-dir "$MDIR"} --deadline $(((cap < left ? cap : left) - 15)) \
      "${MAMBA2_ARGS[@]}"
  fi
  # The longest T the planner fits for the bench model's exact gradient in the GPU's memory
  # (one window, E3 + bf16 storage + layer checkpointing), then `ash grad` at it.
  local lset=() gpu_bytes
  for k in "${BENCH_SET[@]}" data.batch=1 grad.engine=adjoint-exact run.storage=bf16 grad.layer_checkpoint=3; do
    lset+=(--set "$k"); done
  gpu_bytes=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
  step b_longest_T_plan 60 bash "$ROOT/perf_tests/gpu/longest_t.sh" --ash "$ASH" --out "$RES/b_longest_T.txt" \
    ${gpu_bytes:+--max-memory $((gpu_bytes * 1048576))} --max-T "$LONGEST_MAX" -- "${lset[@]}"
  if [ -s "$RES/b_longest_T.txt" ]; then
    local lt; lt=$(cat "$RES/b_longest_T.txt")
    head -c $((lt + 1)) /dev/urandom | base64 -w 0 | head -c $((lt + 1)) > "$WORKDIR/longest_tokens.txt"
    step b_longest_T_init 60 "$ASH" init --precision float --out "$WORKDIR/bench.h5" "${lset[@]:0:8}"
    step b_longest_T_grad 240 "$ASH" grad --checkpoint "$WORKDIR/bench.h5" --tokens "$WORKDIR/longest_tokens.txt" \
      --out "$WORKDIR/longest_grad.h5" "${lset[@]}" --set "data.seq_len=$lt"
  else
    skip b_longest_T_grad "no planned T (b_longest_T_plan)"
  fi
  local m
  for m in fp32 tf32 bf16; do
    step "b_matmul_$m" 90 "$G" --precision float --engines forward,adjoint-exact --T "$MM_T" --reps "$REPS" \
      "${MM[@]}" --matmul "$m" --json "$RES/b_matmul_$m.jsonl"
  done
  if [ -x "$B/bin/test_distributed" ] && [ -n "${MPIEXEC:-}" ]; then
    local aware
    aware="$("$(dirname "$MPIEXEC")/ompi_info" --parsable --all 2>/dev/null | grep -m1 -E '(mpi|opal)_built_with_cuda_support:value' | cut -d: -f7)"
    say "MPI: $("$MPIEXEC" --version 2>/dev/null | head -1); CUDA-aware: ${aware:-unknown}"
    echo "${aware:-unknown}" > "$RES/b_mpi_cuda_aware.txt"
    step b_mpi_distributed_np2 180 $ASH_MPIEXEC -n 2 "$B/bin/test_distributed" --gtest_brief=1 \
      "--gtest_filter=$MPI_FILTER"
    [ -x "$B/bin/test_distributed_cli" ] && step b_mpi_distributed_cli 180 "$B/bin/test_distributed_cli" \
      --gtest_brief=1 "--gtest_filter=$MPI_CLI_FILTER"
  else
    skip b_mpi_distributed_np2 "no test_distributed or mpiexec"
  fi
  # The 1.36 B model last (measured on 2026-11-26; its final checkpoint, about 20 GB with
  # the Adam moments, outlasted the cap): its plan first (printed, kept), then 3 AdamW steps
  # on one 100K window.
  local set=() k
  for k in "${BIG[@]}" data.seq_len="$BIG_T" data.batch=1 data.valid_fraction=0 grad.engine=adjoint-exact \
           run.storage=bf16 grad.layer_checkpoint=9 optim.steps=3 optim.warmup=0 run.log_every=1 run.eval_every=0 \
           run.ckpt_every=0 run.out_dir="$WORKDIR/big"; do set+=(--set "$k"); done
  head -c $((4 * BIG_T)) /dev/urandom | base64 -w 0 > "$WORKDIR/big_tokens.txt"
  set+=(--set "data.train=$WORKDIR/big_tokens.txt")
  step b_big_plan 30 "$ASH" plan --precision float "${set[@]}"
  step b_big_train 300 "$ASH" train --set run.precision=float "${set[@]}"
  ssmstack_steps
}

# SSMStack on CUDA tensors, after stage B's other steps: the Python module built here for
# this machine's Python from the bundle's sdk/ (the step's time is the build's), then
# perf_tests/gpu/ssmstack_cuda.py checks it against PyTorch autograd on the same GPU and
# times it beside it. The host dry run uses the host build's module instead (a CPU build:
# the same script, on the CPU), and says so.
ssmstack_steps() {
  local pyb="$WORKDIR/python-build" pypath="" cap=200 left
  if [ "$QUICK" = 1 ]; then
    if ls "$BUILD"/python/adjoint_sharding/_core*.so >/dev/null 2>&1; then
      skip b_ssmstack_build "host dry run: the host build's module ($BUILD/python) stands in for the CUDA build"
      pypath="$BUILD/python"
    else
      skip b_ssmstack_build "host dry run: the host build has no Python module (-DASH_ENABLE_PYTHON=ON)"
    fi
  elif [ -d "$B/sdk" ]; then
    [ "$FROM" = b_ssmstack_cuda ] && REACHED=1  # the build is the check's prerequisite
    step b_ssmstack_build 240 env PYTHONPATH="$B/sdk/python" MPI_HOME="$B/openmpi" bash -c '
      command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
      gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
      cmake "${gen[@]}" -S "$1/python" -B "$2" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$3/sdk" \
        -DCMAKE_CXX_COMPILER="$3/sdk/bin/nvcc_wrapper" -DMPI_HOME="$3/openmpi" -DPython_EXECUTABLE="$(command -v "$4")" &&
      cmake --build "$2" -j "$(nproc)"' _ "$ROOT" "$pyb" "$B" "$PY"
    if [[ "$(tail -1 "$RES/steps.jsonl")" == *'"status":"not_run"'* ]]; then  # no time to build: none to check
      NOT_RUN+=(b_ssmstack_cuda); record b_ssmstack_cuda not_run 0 0 0 "budget: b_ssmstack_build did not run"
      return 0
    fi
    ls "$pyb"/adjoint_sharding/_core*.so >/dev/null 2>&1 && pypath="$pyb"
  else
    skip b_ssmstack_build "the bundle has no sdk/ (bundle.sh's sdk step: built before it)"
  fi
  if [ -z "$pypath" ]; then
    skip b_ssmstack_cuda "no Python module (b_ssmstack_build)"
    return 0
  fi
  if ! "$PY" -c "import torch" 2>/dev/null; then
    skip b_ssmstack_cuda "no torch for $PY"
    return 0
  fi
  left=$((BUDGET - RESERVE - (SECONDS - T_START)))
  step b_ssmstack_cuda "$cap" env PYTHONPATH="$pypath" "$PY" "$ROOT/perf_tests/gpu/ssmstack_cuda.py" \
    --out "$RES/ssmstack" --deadline $(((cap < left ? cap : left) > 90 ? (cap < left ? cap : left) - 60 : 30)) \
    $([ "$QUICK" = 1 ] && echo --quick)
}

stage_C() {
  local tf
  for tf in "${CLI_TEST_FILTERS[@]}"; do
    step "c_${tf%%:*}" 240 "$B/bin/${tf%%:*}" "--gtest_filter=${tf#*:}" --gtest_brief=1
  done
  if [ "$QUICK" = 1 ]; then
    skip c_index_width "64 GB test: GPU only"
  else
    step c_index_width 300 "$B/bin/test_index_width" --gtest_brief=1
  fi
  if command -v compute-sanitizer >/dev/null; then
    step c_racecheck_e3_fused 240 compute-sanitizer --tool racecheck --error-exitcode 1 \
      "$B/bin/test_adjoint_exact" '--gtest_filter=AdjointExact.Fused*:AdjointExact.Walk*:AdjointExact.Deterministic'
  else
    skip c_racecheck_e3_fused "compute-sanitizer not found"
  fi
  step c_small_fused_sweep 240 "$G" --precision float --engines forward,adjoint-exact --e3-form fused --T "$SMALL_T" \
    --reps "$REPS" --json "$RES/c_small_fused_sweep.jsonl"
  step c_small_waves_sweep 180 "$G" --precision float --engines adjoint-exact --e3-form waves --T "$SMALL_T" \
    --reps "$REPS" --json "$RES/c_small_waves_sweep.jsonl"
  step c_bench_waves 120 "$G" --precision float --engines adjoint-exact --e3-form waves --T "$BENCH_T" --reps 1 --warmup 1 \
    "${BENCH[@]}" --json "$RES/c_bench_waves.jsonl"
  step c_kernels 180 "$KB" --benchmark_min_time=$([ "$QUICK" = 1 ] && echo 0 || echo 0.3) \
    "--benchmark_filter=$([ "$QUICK" = 1 ] && echo '/(1024|16777216)(/|$)' || echo .)" \
    --benchmark_out="$RES/c_kernels.json" --benchmark_out_format=json
}

# Preflight: every library of the bundle's binaries loads (a bundle that does not costs
# seconds, not the window). On a failure no stage runs.
STAGE=0
unresolved="$(for f in "$B"/bin/*; do ldd "$f" 2>/dev/null | grep "not found" | sed "s|^|$(basename "$f"): |"; done | sort -u)"
if [ -n "$unresolved" ]; then
  record preflight failed 0 0 1 "unresolved: $(echo "$unresolved" | head -5 | tr '\n' ';')"
  say "preflight failed: libraries not found (nothing run):"; echo "$unresolved" | head -20 | tee -a "$RES/steps.log"
  FAILED=1 STAGES=""
else
  record preflight passed 0 0 0 "every library of bin/ resolves"
fi

for ((i = 0; i < ${#STAGES}; i++)); do
  STAGE=${STAGES:$i:1}
  say "stage $STAGE: $((BUDGET - (SECONDS - T_START))) s of the budget left"
  "stage_$STAGE"
done

# --- summary and packing: at most 8 files in --out -----------------------------------------------
{
  echo "# gpu_run.sh --stage $STAGES${FROM:+ --from $FROM} (budget $BUDGET s, $((SECONDS - T_START)) s used)"
  echo; echo '```'; cat "$RES/machine.txt"; echo '```'; echo
  echo "| stage | step | status | s | limit | note |"; echo "|---|---|---|---|---|---|"
  "$PY" - "$RES/steps.jsonl" <<'EOF' 2>/dev/null || sed 's/^/    /' "$RES/steps.jsonl"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"| {r['stage']} | {r['step']} | {r['status']} | {r['seconds']} | {r['limit']} | {r['note'][:160]} |")
EOF
  echo
  if [ ${#NOT_RUN[@]} -gt 0 ]; then
    echo "Not run (budget): ${NOT_RUN[*]}. The next window: --stage $STAGES --from ${NOT_RUN[0]}"
  else
    echo "Every step of stage(s) $STAGES ran; $FAILED failed."
  fi
  echo; echo "## Benchmark rows"; echo
  for f in "$RES"/*.jsonl "$RES"/mamba/summary.md "$RES"/mamba_block/summary.md "$RES"/mamba2/summary.md "$RES"/ssmstack/check.json \
           "$RES"/ssmstack/sweep.jsonl; do
    [ -f "$f" ] && [ "$(basename "$f")" != steps.jsonl ] || continue
    echo "### ${f#"$RES"/}"; echo '```'; head -c 4000 "$f"; echo '```'
  done
} > "$RES/summary.md"
cp "$RES/summary.md" "$RES/steps.jsonl" "$RES/machine.txt" "$OUT/" 2>/dev/null
tar -C "$WORKDIR" --exclude="*.h5" -czf "$OUT/results.tar.gz" results
say "$FAILED step(s) failed${NOT_RUN:+; not run: ${NOT_RUN[*]}}; $((SECONDS - T_START)) s; $(ls "$OUT" | wc -l) files in $OUT"
rm -rf "$WORKDIR"
exit "$FAILED"
