"""Our safetensors reader/writer and Hugging Face Mamba mapping (src/ash/io/safetensors,
src/ash/app/hf_mamba) against the Python packages themselves: files that
`safetensors.torch.save_file` and `MambaForCausalLM.save_pretrained` write are read by
us with the same values, and files we write are loaded by `safetensors` and by
`MambaForCausalLM.from_pretrained` with the same tensors, bit for bit. ctest
safetensors_interop runs it (pytest) with ASH_SAFETENSORS_TOOL = unit_tests/safetensors_tool.
"""
import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import MambaConfig, MambaForCausalLM

TOOL = os.environ.get("ASH_SAFETENSORS_TOOL", "")
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def tool():
    assert TOOL and os.access(TOOL, os.X_OK), "set ASH_SAFETENSORS_TOOL to the safetensors_tool executable"
    return TOOL


def run(tool, *args, code=0):
    r = subprocess.run([tool, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == code, f"safetensors_tool {args}: exit {r.returncode}: {r.stderr}"
    return r


def same_bits(a, b):
    """Equal bit for bit (dtype, shape and every byte)."""
    return a.dtype == b.dtype and a.shape == b.shape and \
        a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8))


def random_tensors(seed):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, dt in enumerate(DTYPES):
        name = str(dt).split(".")[1]
        out[f"{name}.matrix"] = (torch.randn(7, 5, generator=g, dtype=torch.float64) * 10 ** (i - 2)).to(dt)
        out[f"{name}.vector"] = torch.randn(13, generator=g).to(dt)
        out[f"{name}.empty"] = torch.zeros(0, 3, dtype=dt)
        out[f"{name}.scalar"] = torch.tensor(-2.5, dtype=dt)
    out["float32.special"] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38])
    out["float16.subnormal"] = torch.tensor([6e-8, -6e-8, 65504.0], dtype=torch.float16)
    return out


def test_save_file_read_exactly(tool, tmp_path):
    """Every dtype's values read as double (and float) exactly, written back in F64/F32."""
    src = random_tensors(1)
    save_file(src, tmp_path / "src.safetensors", metadata={"format": "pt"})
    run(tool, "convert", tmp_path / "src.safetensors", tmp_path / "f64.safetensors", "f64")
    run(tool, "convert", tmp_path / "src.safetensors", tmp_path / "f32.safetensors", "f32")
    f64 = load_file(tmp_path / "f64.safetensors")
    f32 = load_file(tmp_path / "f32.safetensors")
    assert sorted(f64) == sorted(src) == sorted(f32)
    for name, t in src.items():
        assert same_bits(f64[name], t.double()), name
        assert same_bits(f32[name], t.float()), name  # F64 into float: rounded to nearest, as torch


def test_copy_byte_identical_to_save_file(tool, tmp_path):
    """What we write from what we read is the file save_file wrote, byte for byte:
    dtype-then-name order, key order, escapes, padding, metadata."""
    src = random_tensors(2)
    src.update({"a\tb": torch.ones(2), 'q"uote': torch.ones(1, dtype=torch.float64), "é": torch.ones(3, dtype=torch.bfloat16),
                "back\\slash": torch.ones(1, dtype=torch.float16), "ctl\x01": torch.ones(1), "B": torch.ones(1)})
    for meta in ({"format": "pt"}, None):
        save_file(src, tmp_path / "src.safetensors", metadata=meta)
        run(tool, "copy", tmp_path / "src.safetensors", tmp_path / "copy.safetensors")
        assert (tmp_path / "copy.safetensors").read_bytes() == (tmp_path / "src.safetensors").read_bytes(), meta
        back = load_file(tmp_path / "copy.safetensors")
        assert all(same_bits(back[k], v) for k, v in src.items())


def tiny_model(tied, seed, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = MambaConfig(hidden_size=16, state_size=4, num_hidden_layers=2, vocab_size=50, tie_word_embeddings=tied)
    m = MambaForCausalLM(cfg)
    with torch.no_grad():  # off the special initial values (D = 1, A_log = log n, ...)
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return m.to(dtype)


def hf_to_ash_name(hf):
    """The mapping of issue 34, written out independently of the C++ tables."""
    fixed = {"backbone.embeddings.weight": "embedding", "backbone.norm_f.weight": "final_norm", "lm_head.weight": "head"}
    if hf in fixed:
        return fixed[hf]
    parts = hf.split(".")
    layer = f"layers/{int(parts[2]):03d}/"
    rest = ".".join(parts[3:])
    return layer + {"norm.weight": "norm", "mixer.in_proj.weight": "in_proj", "mixer.conv1d.weight": "conv_weight",
                    "mixer.conv1d.bias": "conv_bias", "mixer.x_proj.weight": "x_proj", "mixer.dt_proj.weight": "dt_proj",
                    "mixer.dt_proj.bias": "dt_bias", "mixer.A_log": "A_log", "mixer.D": "D",
                    "mixer.out_proj.weight": "out_proj"}[rest]


def check_read(tool, folder, model, tmp_path, src_dtype):
    run(tool, "hf-read", folder, tmp_path / "ash.safetensors", tmp_path / "ash.json")
    ours = load_file(tmp_path / "ash.safetensors")
    info = json.loads((tmp_path / "ash.json").read_text())
    c = model.config
    assert info["config"] == {"model": {"arch": "mamba", "width": 16, "state": 4, "layers": 2, "vocab": 50, "expand": 2,
                                        "conv_kernel": 4, "dt_rank": c.time_step_rank,
                                        "tie_embeddings": c.tie_word_embeddings, "norm_eps": 1e-5}}
    state = model.state_dict()
    expected = {k for k in state if not (c.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(ours) == sorted(hf_to_ash_name(k) for k in expected)
    for k in expected:
        a = hf_to_ash_name(k)
        want = state[k].double()
        if k.endswith("conv1d.weight"):
            want = want.reshape(want.shape[0], want.shape[2])  # [E, 1, Kc] -> [E, Kc]
        assert same_bits(ours[a], want), k
        assert info["dtypes"][a] == src_dtype
    return ours, info


@pytest.mark.parametrize("tied", [True, False])
def test_save_pretrained_read_and_written_back(tool, tmp_path, tied):
    model = tiny_model(tied, seed=3 + tied)
    model.save_pretrained(tmp_path / "hf")
    check_read(tool, tmp_path / "hf", model, tmp_path, "F32")
    # The sharded folder of the same model: the same tensors.
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 2
    (tmp_path / "one").mkdir()
    ours, _ = check_read(tool, tmp_path / "sharded", model, tmp_path / "one", "F32")

    # Written by us in F32: the model.safetensors transformers wrote, byte for byte,
    # and from_pretrained loads every tensor bit for bit and gives the same logits.
    info = json.loads((tmp_path / "ash.json").read_text())
    (tmp_path / "cfg.json").write_text(json.dumps(info["config"]))
    run(tool, "hf-write", tmp_path / "ash.safetensors", tmp_path / "cfg.json", tmp_path / "out32", "f32")
    assert (tmp_path / "out32" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    loaded = MambaForCausalLM.from_pretrained(tmp_path / "out32")
    assert loaded.config.tie_word_embeddings == tied
    want = model.state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k]), k
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the same parameters bit for bit (above); logits within float32's rounding
        # of their scale, since two separately built torch models may take different CPU kernels
        out, ref = loaded(ids).logits, model(ids).logits
        assert (out - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())

    # In F64: loaded as float64 (config "dtype"), every tensor the double of the original.
    run(tool, "hf-write", tmp_path / "ash.safetensors", tmp_path / "cfg.json", tmp_path / "out64", "f64")
    cfg64 = json.loads((tmp_path / "out64" / "config.json").read_text())
    assert cfg64["dtype"] == "float64" and cfg64["residual_in_fp32"] is False
    loaded64 = MambaForCausalLM.from_pretrained(tmp_path / "out64")
    assert loaded64.dtype == torch.float64 and loaded64.config.residual_in_fp32 is False
    for k, v in loaded64.state_dict().items():
        assert same_bits(v, want[k].double()), k
    # And what we wrote reads back through our reader unchanged.
    (tmp_path / "again").mkdir()
    again, _ = check_read(tool, tmp_path / "out64", model, tmp_path / "again", "F64")
    assert all(same_bits(again[k], v) for k, v in ours.items())


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "BF16"), (torch.float16, "F16"), (torch.float64, "F64")])
def test_half_and_double_folders_read_exactly(tool, tmp_path, dtype, name):
    model = tiny_model(False, seed=7, dtype=dtype)
    model.save_pretrained(tmp_path / "hf")
    check_read(tool, tmp_path / "hf", model, tmp_path, name)


def test_hostile_folders_refused(tool, tmp_path):
    model = tiny_model(True, seed=9)
    model.save_pretrained(tmp_path / "hf", max_shard_size="4KB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first = next(iter(doc["weight_map"]))
    shard = doc["weight_map"][first]
    # A shard name leading out of the folder.
    os.replace(tmp_path / "hf" / shard, tmp_path / shard)
    doc["weight_map"] = {k: ("../" + v if v == shard else v) for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    r = run(tool, "hf-read", tmp_path / "hf", tmp_path / "o.safetensors", tmp_path / "o.json", code=2)
    assert f'shard "../{shard}"' in r.stderr and "not a plain file name" in r.stderr
    # ... or a link in the folder to a file outside it.
    doc["weight_map"] = {k: v.replace("../", "") for k, v in doc["weight_map"].items()}
    index.write_text(json.dumps(doc))
    os.symlink(tmp_path / shard, tmp_path / "hf" / shard)
    r = run(tool, "hf-read", tmp_path / "hf", tmp_path / "o.safetensors", tmp_path / "o.json", code=2)
    assert "outside the folder" in r.stderr
    # A truncated file written by save_file.
    save_file({"w": torch.ones(100)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-4])
    r = run(tool, "list", tmp_path / "t.safetensors", code=2)
    assert 'tensor "w"' in r.stderr and "run past" in r.stderr
