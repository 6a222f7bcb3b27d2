#!/usr/bin/env bash
# ctest mamba_baseline_smoke: mamba_baseline.py's mapping of our layer onto mamba-ssm's
# selective scan, checked on the host with mamba-ssm's own pure-PyTorch reference
# (selective_scan_ref) against `ash grad` (loss and every gradient), and the same check
# made to fail by a wrong mapping (--mutate). Exit 77 (skipped) without torch or mamba_ssm.
#   mamba_baseline_smoke.sh PYTHON ASH WORKDIR
set -euo pipefail
py=$1 ash=$2 work=$3
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! "$py" -c "import torch, einops, importlib.util as u; assert u.find_spec('mamba_ssm')" 2>/dev/null; then
  echo "torch, einops or mamba_ssm is not installed: skipped"; exit 77
fi
rm -rf "$work" && mkdir -p "$work"
"$ash" init --out "$work/model.h5" --precision float --set model.width=24 --set model.state=5 \
  --set model.layers=3 --set model.vocab=64 --set model.seed=7 > /dev/null
base=("$py" "$here/mamba_baseline.py" --scan ref --device cpu --threads 1 --checkpoint "$work/model.h5"
      --check-ash "$ash" --T 96 --batch 2 --reps 1)
"${base[@]}"
echo "--- the same check with a wrong mapping must fail:"
if "${base[@]}" --mutate --no-sweep; then
  echo "mamba_baseline_smoke: --mutate passed the check" >&2; exit 1
fi
echo "mamba_baseline_smoke: passed"
