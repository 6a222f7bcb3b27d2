#!/usr/bin/env bash
# The Hugging Face round trip a newcomer can run (issue 34 part 6): `ash train` a
# small byte-level Mamba on the fortunes corpus (examples/configs/mamba_fortunes.json,
# a few minutes on a CPU), `ash export-hf` it, load the folder with transformers'
# MambaForCausalLM.from_pretrained and generate greedily from a prompt, then
# `ash generate --temperature 0` from the checkpoint: the same bytes.
#
#   examples/mamba_roundtrip.sh [--ash PATH] [--python PY] [--work DIR] [--corpus FILE]
#                               [--prompt TEXT] [--tokens N] [--set key=value ...]
#
# --python: an interpreter with torch and transformers (default $ASH_PYTHON, else
# python3; unit_tests/run.sh installs both in its venv). --set is passed to
# `ash train` (the ctest smoke trains a tiny model for a few steps). Exit 77 when
# the interpreter lacks torch or transformers.
set -euo pipefail
tag=mamba work="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/mamba-roundtrip" tokens=120
source "$(dirname "${BASH_SOURCE[0]}")/roundtrip_common.sh"
rm -rf "$work/run" "$work/hf"

# 1. Train (E1, grad.engine=backprop: what a Mamba trains with today).
"$ASH" train --config "$here/configs/mamba_fortunes.json" --set "data.train=$corpus" \
  --set "run.out_dir=$work/run" "${sets[@]}"

# 2. Export: config.json + model.safetensors in the checkpoint's precision.
"$ASH" export-hf --checkpoint "$work/run/checkpoint.h5" --out "$work/hf"

# 3. transformers: greedy generation from the folder alone. In float64 (the F32
# tensors convert exactly), the arithmetic closest to ash generate's double; token 0
# is no end-of-text here (a byte model: MambaConfig's eos_token_id 0 is a NUL byte).
"$PY" - "$work/hf" "$prompt" "$tokens" "$work/transformers.txt" <<'PYEOF'
import sys
import torch
import transformers
folder, prompt, n, out = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), sys.argv[4]
model = transformers.MambaForCausalLM.from_pretrained(folder).to(torch.float64).eval()
ids = torch.tensor([list(prompt)], dtype=torch.long)
with torch.no_grad():
    got = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
text = bytes(got[0].tolist())
open(out, "wb").write(text)
print("[mamba] transformers:", text.decode("utf-8", "replace"))
PYEOF

# 4. The same prompt through ash generate, greedy: the same bytes.
"$ASH" generate --checkpoint "$work/run/checkpoint.h5" --prompt "$prompt" --tokens "$tokens" --temperature 0 \
  > "$work/ash.txt"
head -c -1 "$work/ash.txt" > "$work/ash_text.txt"  # ash generate ends its text with a newline
echo "[mamba] ash generate: $(cat "$work/ash_text.txt")"
if cmp "$work/transformers.txt" "$work/ash_text.txt"; then
  echo "[mamba] the same $(wc -c < "$work/ash_text.txt") bytes"
else
  echo "[mamba] ash generate and transformers differ" >&2
  exit 1
fi
