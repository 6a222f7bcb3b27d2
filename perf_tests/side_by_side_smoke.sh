#!/usr/bin/env bash
# ctest mamba_vs_ash_smoke / mamba_block_vs_ash_smoke / mamba2_vs_ash_smoke: the side-by-side scripts
# on the host (mamba-ssm's pure-PyTorch references: selective_scan_ref; for Mamba2 ssd_chunk_scan_combined_ref
# and rms_norm_ref; tiny sizes) by perf_tests/side_by_side.py's protocol:
# every row in OUT/rows.jsonl has the named fields, is warm, has min <= median, and the
# losses agree at every T; mamba-ssm's rows come in both modes (autograd, checkpoint),
# mamba_vs_ash.py's kernel-only rows on both sides, mamba_block_vs_ash.py's and mamba2_vs_ash.py's
# fast-path row (measured, or saying why not). Then a deliberate loss mismatch (--mutate-sweep: their
# model changed in the sweep only) must be flagged (rows "loss_ok": false, exit 1); for the
# block scripts the check with their conv taps reversed (--mutate) must fail too.
# Exit 77 (skipped) without torch, einops or mamba_ssm.
#   side_by_side_smoke.sh vs|block|mamba2 PYTHON BUILD WORKDIR [extra arguments of the script]
set -uo pipefail
kind=$1 py=$2 build=$3 work=$4
shift 4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if ! "$py" -c "import torch, einops, importlib.util as u; assert u.find_spec('mamba_ssm')" 2>/dev/null; then
  echo "torch, einops or mamba_ssm is not installed: skipped"; exit 77
fi
case "$kind" in
  vs) script=(mamba_vs_ash.py --python "$py") modes=autograd,checkpoint,kernel mismatch=(--kernel-T "" --batch8-T 0) ;;
  block) script=(mamba_block_vs_ash.py) modes=autograd,checkpoint,fast mismatch=() ;;
  mamba2) script=(mamba2_vs_ash.py) modes=autograd,checkpoint,fast mismatch=() ;;
  *) echo "side_by_side_smoke.sh: vs, block or mamba2, not '$kind'" >&2; exit 2 ;;
esac
fail() { echo "side_by_side_smoke ($kind): $*" >&2; exit 1; }
rm -rf "$work" && mkdir -p "$work"
"$py" "$here/${script[0]}" "${script[@]:1}" --quick --out "$work/fair" --build "$build" "$@" || fail "the quick run failed"
"$py" - "$work/fair/rows.jsonl" "$modes" <<'PY' || fail "rows.jsonl does not follow the protocol"
import json, sys
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]) or ".")
fields = ("side", "mode", "T", "reps", "min_s", "median_s", "peak_bytes", "loss", "loss_ok", "warm")
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert rows, "no rows"
for r in rows:
    missing = [f for f in fields if f not in r]
    assert not missing, f"row without {missing}: {r}"
    assert r["warm"] is True, r
    if r["median_s"] is not None:
        assert r["reps"] >= 2 and r["min_s"] <= r["median_s"], r
    if r["loss"] is not None and r["side"] == "mamba-ssm":
        assert r["loss_ok"] is True, f"loss not compared or off: {r}"
want = sys.argv[2].split(",")
got = {(r["side"], r["mode"]) for r in rows}
for m in want:
    assert ("mamba-ssm", m) in got, f"no mamba-ssm row of mode {m}"
if "kernel" in want:
    assert any(r["side"] == "ash" and r["mode"] == "kernel" and r["median_s"] for r in rows), "no kernel row of ours"
    assert any(r["side"] == "mamba-ssm" and r["mode"] == "kernel" and r["median_s"] for r in rows), "no kernel row of theirs"
if "fast" in want:
    fast = [r for r in rows if r["mode"] == "fast"]
    assert all(r["median_s"] or "not available" in r.get("note", "") for r in fast), fast
print(f"rows.jsonl: {len(rows)} rows, the fields, warm, min <= median, losses compared and agreeing")
PY
echo "--- a deliberate loss mismatch (--mutate-sweep) must be flagged:"
if "$py" "$here/${script[0]}" "${script[@]:1}" --quick --out "$work/mismatch" --build "$build" --mutate-sweep \
     "${mismatch[@]}" "$@"; then
  fail "--mutate-sweep passed"
fi
grep -q '"loss_ok": false' "$work/mismatch/rows.jsonl" || fail "--mutate-sweep: no row has loss_ok false"
grep -qE 'MISMATCH|DISAGREE' "$work/mismatch/summary.md" || fail "--mutate-sweep: the summary does not say so"
if [ "$kind" != vs ]; then
  echo "--- their conv taps reversed must fail the check:"
  "$py" "$here/${script[0]}" --quick --no-sweep --mutate --out "$work/mutate" --build "$build" "$@" &&
    fail "--mutate passed the check"
  grep -q '"passed": false' "$work/mutate/check.json" || fail "--mutate: check.json does not say failed"
fi
echo "side_by_side_smoke ($kind): passed"
