# Sourced by examples/mamba_roundtrip.sh and examples/mamba2_roundtrip.sh (not run
# alone): their options, the interpreter check and the corpus. The caller sets tag
# (its log prefix), work and tokens (its defaults) and passes its arguments; on
# return here, root, ASH, PY, work, corpus, prompt, tokens and sets are set.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
ASH="$root/build/src/ash"
PY="${ASH_PYTHON:-python3}"
corpus=""
prompt="The "
sets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ash) ASH="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --work) work="$2"; shift 2 ;;
    --corpus) corpus="$2"; shift 2 ;;
    --prompt) prompt="$2"; shift 2 ;;
    --tokens) tokens="$2"; shift 2 ;;
    --set) sets+=(--set "$2"); shift 2 ;;
    *) echo "unknown argument '$1'" >&2; exit 2 ;;
  esac
done
if ! "$PY" -c "import torch, transformers" 2>/dev/null; then
  echo "[$tag] $PY has no torch/transformers: skipped"
  exit 77
fi
mkdir -p "$work"
if [ -z "$corpus" ]; then  # the corpus of examples/run.sh: Debian's fortunes
  corpus="$work/fortunes.txt"
  if [ ! -s "$corpus" ]; then
    for f in /usr/share/games/fortunes/*; do
      case "$f" in *.dat|*.u8) ;; *) [ -f "$f" ] && cat "$f" ;; esac
    done > "$corpus"
  fi
fi
echo "[$tag] corpus $corpus: $(wc -c < "$corpus") bytes"
