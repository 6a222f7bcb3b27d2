#!/usr/bin/env bash
# The longest window T (data.seq_len) whose exact gradient `ash plan --for grad` fits in
# --max-memory bytes (default: what ash plan compares with), for the configuration given
# as --set pairs after `--`; written to --out and printed. No allocation: the planner only.
#
#   longest_t.sh --ash ASH --out FILE [--max-memory BYTES] [--max-T T] -- --set k=v ...
#
# Doubling from T = 1024 until the plan does not fit, then bisection to within 1 % (T a
# multiple of 1024). Exit 1 when not even T = 1024 fits.
set -euo pipefail
ash="" out="" mem="" maxT=1073741824
while [ $# -gt 0 ]; do
  case "$1" in
    --ash) ash=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --max-memory) mem=$2; shift 2 ;;
    --max-T) maxT=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "longest_t.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$ash" ] && [ -n "$out" ] || { echo "longest_t.sh: --ash and --out are required" >&2; exit 2; }
fits() {  # fits T: exit status of ash plan (0 fits, 1 does not; anything else is an error)
  local rc=0
  "$ash" plan --for grad --precision float ${mem:+--max-memory "$mem"} "$@" --set "data.seq_len=$T" > /dev/null 2>&1 || rc=$?
  [ "$rc" -le 1 ] || { "$ash" plan --for grad --precision float ${mem:+--max-memory "$mem"} "$@" --set "data.seq_len=$T" >&2; exit 2; }
  return "$rc"
}
T=1024
fits "$@" || { echo "longest_t.sh: T = 1024 does not fit" >&2; exit 1; }
lo=1024 hi=0
while [ "$hi" = 0 ]; do
  T=$((lo * 2))
  if [ "$T" -gt "$maxT" ]; then hi=-1; break; fi
  if fits "$@"; then lo=$T; else hi=$T; fi
done
if [ "$hi" -gt 0 ]; then
  while [ $((hi - lo)) -gt $((lo / 100 > 1024 ? lo / 100 : 1024)) ]; do
    T=$(((lo + hi) / 2 / 1024 * 1024))
    if fits "$@"; then lo=$T; else hi=$T; fi
  done
fi
T=$lo
"$ash" plan --for grad --precision float ${mem:+--max-memory "$mem"} "$@" --set "data.seq_len=$T" || true
if [ "$hi" -gt 0 ]; then echo "longest T that fits: $T (T = $hi does not)"; else echo "longest T that fits: $T (--max-T $maxT reached)"; fi
echo "$T" > "$out"
