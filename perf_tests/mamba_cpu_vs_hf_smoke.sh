#!/usr/bin/env bash
# ctest mamba_cpu_vs_hf_smoke: perf_tests/mamba_cpu_vs_hf.py at tiny sizes (seconds): the three
# gradients (transformers' slow path, its use_mambapy parallel scan, ash E3 on the imported model)
# run and their losses agree to 1e-4; then the same run with ash given a perturbed model
# (--mutate) must fail that check. Exit 77 (skipped) without torch, transformers or mambapy.
#   mamba_cpu_vs_hf_smoke.sh PYTHON ASH WORKDIR
set -euo pipefail
py=$1 ash=$2 work=$3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! "$py" -c "import torch, transformers, mambapy.pscan" 2>/dev/null; then
  echo "torch, transformers or mambapy is not installed: skipped"; exit 77
fi
rm -rf "$work" && mkdir -p "$work"
base=("$py" "$here/mamba_cpu_vs_hf.py" --T-list 80 --width 16 --state 4 --layers 2 --threads 1
      --timeout 120 --ash "$ash")
"${base[@]}" --work "$work/ok" --json "$work/runs.jsonl"
n=$(grep -c '"status": "ok"' "$work/runs.jsonl")
[ "$n" -eq 3 ] || { echo "mamba_cpu_vs_hf_smoke: $n of 3 runs finished" >&2; exit 1; }
echo "--- the same with a perturbed model for ash must fail the loss check:"
if "${base[@]}" --work "$work/mutated" --impls mambapy,ash --mutate; then
  echo "mamba_cpu_vs_hf_smoke: --mutate passed the loss check" >&2; exit 1
fi
echo "mamba_cpu_vs_hf_smoke: passed"
