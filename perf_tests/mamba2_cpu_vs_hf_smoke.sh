#!/usr/bin/env bash
# ctest mamba2_cpu_vs_hf_smoke: perf_tests/mamba2_cpu_vs_hf.py at tiny sizes (seconds; 2 groups,
# T not a multiple of transformers' chunk): the check (loss and every gradient of transformers'
# Mamba2ForCausalLM against ash E3 on the imported model) passes, and both sides' runs of the
# sweep finish with agreeing losses; then ash given a perturbed model (--mutate) must fail the
# check, and with the check skipped, the sweep's loss check. Exit 77 (skipped) without torch,
# transformers or h5py.
#   mamba2_cpu_vs_hf_smoke.sh PYTHON ASH WORKDIR
set -euo pipefail
py=$1 ash=$2 work=$3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! "$py" -c "import torch, transformers, h5py" 2>/dev/null; then
  echo "torch, transformers or h5py is not installed: skipped"; exit 77
fi
rm -rf "$work" && mkdir -p "$work"
base=("$py" "$here/mamba2_cpu_vs_hf.py" --T-list 80 --check-T 40 --width 16 --state 4 --head-dim 8 --n-groups 2
      --layers 2 --chunk-size 16 --threads 1 --timeout 120 --ash "$ash")
"${base[@]}" --work "$work/ok" --json "$work/runs.jsonl"
grep -q '"check": true.*"passed": true' "$work/runs.jsonl" || { echo "mamba2_cpu_vs_hf_smoke: no passed check" >&2; exit 1; }
n=$(grep -c '"status": "ok"' "$work/runs.jsonl")
[ "$n" -eq 2 ] || { echo "mamba2_cpu_vs_hf_smoke: $n of 2 runs finished" >&2; exit 1; }
echo "--- a perturbed model for ash must fail the check:"
if "${base[@]}" --work "$work/mutated" --mutate; then
  echo "mamba2_cpu_vs_hf_smoke: --mutate passed the check" >&2; exit 1
fi
echo "--- and, with the check skipped, the sweep's loss check:"
if "${base[@]}" --work "$work/mutated_sweep" --mutate --no-check; then
  echo "mamba2_cpu_vs_hf_smoke: --mutate --no-check passed the loss check" >&2; exit 1
fi
echo "mamba2_cpu_vs_hf_smoke: passed"
