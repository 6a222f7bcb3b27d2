#!/usr/bin/env bash
# A Hugging Face Mamba-2 through ash and back (issue 43): transformers makes a small
# byte-level Mamba2ForCausalLM and saves it (save_pretrained), `ash import-hf` reads
# the folder, `ash train --resume` trains it 50 steps on a corpus, `ash export-hf`
# writes it back, transformers' Mamba2ForCausalLM.from_pretrained loads the export and
# generates greedily from a prompt, and `ash generate --temperature 0` from the trained
# checkpoint gives the same bytes.
#
#   examples/mamba2_roundtrip.sh [--ash PATH] [--python PY] [--work DIR] [--corpus FILE]
#                                [--prompt TEXT] [--tokens N] [--set key=value ...]
#
# --python: an interpreter with torch and transformers (default $ASH_PYTHON, else
# python3; unit_tests/run.sh installs both in its venv). --set is passed to
# `ash train` after the example's own settings. Exit 77 when the interpreter lacks
# torch or transformers.
set -euo pipefail
tag=mamba2 work="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/build/mamba2-roundtrip" tokens=60
source "$(dirname "${BASH_SOURCE[0]}")/roundtrip_common.sh"
rm -rf "$work/hf_init" "$work/run" "$work/hf"

# 1. transformers: a Mamba-2 over bytes (B and C in two groups of heads), saved as save_pretrained does.
"$PY" - "$work/hf_init" <<'PYEOF'
import sys
import torch
import transformers
torch.manual_seed(0)
cfg = transformers.Mamba2Config(vocab_size=256, hidden_size=32, state_size=16, num_hidden_layers=2, expand=2,
                                head_dim=16, num_heads=4, n_groups=2, conv_kernel=4)
transformers.Mamba2ForCausalLM(cfg).save_pretrained(sys.argv[1])
print("[mamba2] saved a Mamba2ForCausalLM:", sum(p.numel() for p in transformers.Mamba2ForCausalLM(cfg).parameters()),
      "parameters")
PYEOF

# 2. Import: a checkpoint at step 0 with the folder's sizes and keys.
"$ASH" import-hf --from "$work/hf_init" --out "$work/init.h5" --precision float

# 3. Train 50 steps from it (E1, grad.engine=backprop).
mkdir -p "$work/run"
"$ASH" train --resume "$work/init.h5" --set "data.train=$corpus" --set "run.out_dir=$work/run" \
  --set optim.steps=50 --set optim.lr=0.01 --set optim.warmup=5 --set data.seq_len=64 --set data.batch=8 \
  --set run.log_every=10 --set run.eval_every=50 --set run.ckpt_every=50 "${sets[@]}"

# 4. Export: config.json + model.safetensors (F32, the checkpoint's precision).
"$ASH" export-hf --checkpoint "$work/run/checkpoint.h5" --out "$work/hf"

# 5. transformers: greedy generation from the exported folder alone, in float64 (the F32
# tensors convert exactly; the residual kept in float64). Token 2 (Mamba2Config's
# eos_token_id) is a byte here, no end of text.
"$PY" - "$work/hf" "$prompt" "$tokens" "$work/transformers.txt" <<'PYEOF'
import sys
import torch
import transformers
folder, prompt, n, out = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), sys.argv[4]
model = transformers.Mamba2ForCausalLM.from_pretrained(folder).to(torch.float64).eval()
for layer in model.backbone.layers:
    layer.residual_in_fp32 = False
ids = torch.tensor([list(prompt)], dtype=torch.long)
with torch.no_grad():
    got = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
text = bytes(got[0].tolist())
open(out, "wb").write(text)
print("[mamba2] transformers:", text.decode("utf-8", "replace"))
PYEOF

# 6. The same prompt through ash generate, greedy: the same bytes.
"$ASH" generate --checkpoint "$work/run/checkpoint.h5" --prompt "$prompt" --tokens "$tokens" --temperature 0 \
  > "$work/ash.txt"
head -c -1 "$work/ash.txt" > "$work/ash_text.txt"  # ash generate ends its text with a newline
echo "[mamba2] ash generate: $(cat "$work/ash_text.txt")"
if cmp "$work/transformers.txt" "$work/ash_text.txt"; then
  echo "[mamba2] the same $(wc -c < "$work/ash_text.txt") bytes"
else
  echo "[mamba2] ash generate and transformers differ" >&2
  exit 1
fi
