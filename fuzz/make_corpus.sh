#!/usr/bin/env bash
# Seed corpora for the fuzz targets, generated (nothing binary is committed):
#   make_corpus.sh OUT_DIR ASH_BINARY
# OUT_DIR/config/  JSON configurations (valid, and near misses)
# OUT_DIR/json/    JSON texts for the strict parser (the configurations and more)
# OUT_DIR/tokens/  token files' bytes (first byte: 0 text, 1 .u16, 2 .u32)
# OUT_DIR/checkpoint/  edit lists for fuzz_checkpoint (byte flips, and declared
#                  shapes of 2^40 elements: fuzz/shape_seed.py), and
#                  OUT_DIR/checkpoint.h5, the valid checkpoint they edit (written by `ash init`)
# OUT_DIR/output/  what fuzz_output plants at the output, the lock and temporary names (and, from the
#                  7th byte, at an exported folder and its config.json)
# OUT_DIR/safetensors/  safetensors files (valid in each dtype, and near misses)
# OUT_DIR/hf_roundtrip/  sizes and values of Mamba folders to write and read back (each dtype, tied and not)
set -euo pipefail
out=$1
ash=$2
mkdir -p "$out/hf_roundtrip"
for seed in '\000\000\000\000\000\000\000\000' '\017\007\003\002\001\003\002\001' '\010\004\002\001\002\001\000\002' \
  '\005\010\004\000\000\002\003\005' '\001\002\001\002\001\000\001\007\200\177\001\377'; do
  printf "$seed" > "$out/hf_roundtrip/seed$(ls "$out/hf_roundtrip" | wc -l)"
done
mkdir -p "$out/config" "$out/json" "$out/tokens" "$out/checkpoint" "$out/output" "$out/safetensors"
for seed in '\000\000\000' '\002\000\000' '\000\002\000' '\006\006\004\005' '\003\005\005\003' '\001\004\006\002' \
  '\005\000\000\000\000\000\000\000' '\004\000\000\000\000\000\004\001' '\000\000\000\000\000\000\004\005' \
  '\000\000\000\000\000\000\004\002' '\002\000\000\000\000\000\005\000'; do
  printf "$seed" > "$out/output/seed$(ls "$out/output" | wc -l)"
done
n=0
for doc in '{}' \
  '{"model": {"vocab": 256, "width": 64, "state": 16, "layers": 2, "seed": 1234}}' \
  '{"data": {"seq_len": 256, "batch": 4, "sequential": true, "carry_state": true}}' \
  '{"grad": {"engine": "adjoint-exact", "truncate": 0, "chunk": 64, "wave": "auto", "layer_checkpoint": "auto"}}' \
  '{"optim": {"lr": 0.003, "weight_decay": 0.1, "warmup": 50, "steps": 1000, "clip": 1.0}}' \
  '{"run": {"out_dir": "run", "precision": "double", "storage": "bf16"}, "dist": {"layer_ranks": 2, "seq_ranks": 1}}' \
  '{"model": {"width": 8, "width": 9}}' '{"model": {"layers": 2.5}}' '[[[[[[1]]]]]]' '{"a": "\u0000"}'; do
  printf '%s' "$doc" > "$out/config/seed$((n++))"
done
cp -r "$out/config/." "$out/json/"
n=0
for doc in '{"a":{}}' '[{}, [], {"b": [1, 2.5e-3, -7, "x\\u00e9"]}]' '"s"' 'null' '{"a": 1, "b": {"a": 2}}' \
  '{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}    ' '{"k": 1}\000x' '\357\273\277{}' '{"k": 1} x'; do
  printf "$doc" > "$out/json/extra$((n++))"
done
printf '\000%s' "the quick brown fox jumps over the lazy dog" > "$out/tokens/text"
printf '\001\001\000\002\000\003\000\377\377' > "$out/tokens/u16"
printf '\002\001\000\000\000\377\377\377\377' > "$out/tokens/u32"
"$ash" init --set model.vocab=16 --set model.width=4 --set model.state=2 --set model.layers=1 \
  --out "$out/checkpoint.h5" > /dev/null
size=$(stat -c %s "$out/checkpoint.h5")
for i in 0 1 2 3 4 5 6 7; do  # a few single-byte edits spread over the file
  python3 -c "import struct,sys; sys.stdout.buffer.write(struct.pack('<IB', ($i * $size) // 8 + 17, 1 << ($i % 8)))" \
    > "$out/checkpoint/edit$i"
done
# Declared shapes (issue 35): /params/final_norm and /params/embedding 2^40 elements
# longer per dimension, their object headers' checksums recomputed so HDF5 opens them.
for rank in 1 2; do
  python3 "$(dirname "${BASH_SOURCE[0]}")/shape_seed.py" "$out/checkpoint.h5" "$rank" "$out/checkpoint/shape$rank"
done
# safetensors files as the `safetensors` package writes them (fuzz_safetensors reads
# the input as a whole file): every dtype, metadata, an empty tensor; then near misses.
python3 - "$out/safetensors" <<'PY'
import json, struct, sys
def st(tensors, meta=None, pad=True, extra=b""):
    header, data = {}, b""
    if meta is not None:
        header["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data + extra
seeds = {
    "all": st([("a", "F64", [2], struct.pack("<2d", 1.5, -0.0)), ("b", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)),
               ("c", "BF16", [1], b"\x80\x3f"), ("d", "F16", [3], b"\x00\x3c\x00\x7c\x01\x00"),
               ("e", "F32", [0, 4], b"")], {"format": "pt"}),
    "empty": st([]),
    "nan": st([("n", "F32", [2], struct.pack("<2I", 0x7f800001, 0xffc00000)), ("h", "F16", [1], b"\x01\x7c")]),
    "overlap": st([("a", "F32", [1], b"1234"), ("b", "F32", [1], b"5678")]).replace(b"[4,8]", b"[0,4]"),
    "trailing": st([("a", "F32", [1], b"1234")], extra=b"zz"),
    "dtype": st([("a", "I64", [1], b"12345678")]),
    "shape": st([("a", "F32", [1099511627776], b"1234")]),
}
for name, data in seeds.items():
    open(f"{sys.argv[1]}/{name}", "wb").write(data)
PY
