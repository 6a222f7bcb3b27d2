"""`ash import-hf` / `ash export-hf` and Python's import_hf / export_hf (issue 34,
docs/cli.md): folders transformers saved, imported and written back bit for bit;
the imported model's loss against transformers' own in float64 (the slow path with
its float32 casts removed, as test_mamba.py states); an `ash init` Mamba exported and
loaded by MambaForCausalLM.from_pretrained with the same loss and logits; hostile
folders and non-Mamba checkpoints refused with exit 2 naming what is wrong.
"""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess

import numpy as np
import pytest

import adjoint_sharding as ash
from conftest import run_cli

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from test_mamba import RTOL, float64_slow_path, hf_model  # noqa: E402,F401  (a fixture, used by name)


def load_tensors(folder):
    return safetensors_numpy.load_file(str(folder / "model.safetensors"))


def assert_bitwise(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert a[name].tobytes() == b[name].tobytes(), name


def saved(model, folder, dtype):
    model.to(dtype).save_pretrained(folder)
    return folder


def f64(model):
    """A loaded model in float64 with residual_in_fp32 off (an F32 folder's config.json has it on,
    as transformers' default; the float64 oracle keeps the residual in float64)."""
    for layer in model.backbone.layers:
        layer.residual_in_fp32 = False
    return model.to(torch.float64).eval()


def fail_cli(cli, *args):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stderr


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "float"), (torch.float64, "double")])
@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_bitwise(tmp_path, ash_cli, dtype, precision, tied):
    """A save_pretrained folder, import-hf, export-hf: the same tensors, bit for bit."""
    model = hf_model(13, 6, 4, 2, 2, 3, 2, tied, 1e-5, seed=11)
    src = saved(model, tmp_path / "src", dtype)
    ck, out = tmp_path / "m.h5", tmp_path / "out"
    printed = run_cli(ash_cli, "import-hf", "--from", src, "--out", ck, "--precision", precision)
    assert ("F32" if dtype == torch.float32 else "F64") in printed
    assert ("tied" if tied else "untied") in printed
    assert ash.load(ck).precision == precision
    run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", out)
    before, after = load_tensors(src), load_tensors(out)
    before.pop("lm_head.weight", None) if tied else None  # a tied copy, if this saver kept one
    assert_bitwise(before, after)
    loaded = transformers.MambaForCausalLM.from_pretrained(out)
    assert loaded.config.tie_word_embeddings == tied and loaded.dtype == dtype


def test_float_folder_into_double_and_back(tmp_path, ash_cli):
    """F32 imported in double is exact: --dtype float writes the same F32 bits; the default F64."""
    src = saved(hf_model(13, 6, 4, 1, 2, 4, 1, True, 1e-5, seed=3), tmp_path / "src", torch.float32)
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "import-hf", "--from", src, "--out", ck)  # default precision double
    run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "f", "--dtype", "float")
    assert_bitwise(load_tensors(src), load_tensors(tmp_path / "f"))
    run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "d")
    wide = load_tensors(tmp_path / "d")
    for name, v in load_tensors(src).items():
        assert wide[name].dtype == np.float64 and np.array_equal(wide[name], v.astype(np.float64)), name


def test_python_functions(tmp_path):
    """import_hf / export_hf call the same library functions: the same bytes as the tool."""
    src = saved(hf_model(11, 5, 3, 2, 2, 2, 1, False, 1e-5, seed=4), tmp_path / "src", torch.float64)
    r = ash.import_hf(src, tmp_path / "m.h5")
    assert r["source_dtypes"] == "F64" and r["config"]["model"]["arch"] == "mamba"
    assert r["config"]["model"]["tie_embeddings"] is False and r["config"]["run"]["precision"] == "double"
    assert r["parameters"] == sum(v.size for v in ash.load(tmp_path / "m.h5").values())
    w = ash.export_hf(tmp_path / "m.h5", tmp_path / "out")
    assert w == {"dtype": "F64", "parameters": r["parameters"]}
    assert_bitwise(load_tensors(src), load_tensors(tmp_path / "out"))
    with pytest.raises(ash.Error, match="half"):
        ash.export_hf(tmp_path / "m.h5", tmp_path / "x", dtype="half")


def test_imported_loss_matches_transformers(tmp_path, ash_cli, float64_slow_path):
    """A folder saved by transformers, imported: `ash eval` and evaluate give transformers' loss."""
    V, D, N, K, T, B = 13, 6, 4, 3, 11, 2
    model = hf_model(V, D, N, K, 2, 4, 2, False, 1e-4, seed=21)
    src = saved(model, tmp_path / "src", torch.float64)
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "import-hf", "--from", src, "--out", ck)
    ids = np.random.default_rng(5).integers(0, V, B * T).astype("<u4")
    x = torch.tensor(ids.reshape(B, T), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).item()
    ev = ash.evaluate(ck, ids, seq_len=T, batch=B)
    assert abs(ev["loss"] - ref) <= RTOL * ref, (ev, ref)
    tokens = tmp_path / "t.u32"
    ids.tofile(tokens)
    out = run_cli(ash_cli, "eval", "--checkpoint", ck, "--tokens", tokens, "--set", f"data.seq_len={T}",
                  "--set", f"data.batch={B}")
    assert abs(float(out.split("loss ")[1].split(" nats")[0]) - ref) <= 1e-6, (out, ref)


@pytest.mark.parametrize("precision", ["double", "float"])
def test_exported_init_model_loads_in_transformers(tmp_path, ash_cli, float64_slow_path, precision):
    """An `ash init` Mamba, exported: from_pretrained gives ash's loss (float64 compute) to 1e-10,
    and the logits of the F32 folder equal those of the F64 one loaded from the same float model."""
    V, T, B = 37, 9, 2
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "init", "--out", ck, "--precision", precision, "--set", "model.arch=mamba",
            "--set", f"model.vocab={V}", "--set", "model.width=8", "--set", "model.state=3",
            "--set", "model.layers=2", "--set", "model.tie_embeddings=false", "--set", "model.dt_rank=2")
    out = tmp_path / "hf"
    printed = run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", out)
    assert ("F64" if precision == "double" else "F32") in printed
    back = tmp_path / "back.h5"  # and imported again: the same parameters, bit for bit
    run_cli(ash_cli, "import-hf", "--from", out, "--out", back, "--precision", precision)
    a, b = ash.load(ck), ash.load(back)
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes() for k in a)
    model = f64(transformers.MambaForCausalLM.from_pretrained(out))
    ids = np.random.default_rng(8).integers(0, V, B * T).astype("<u4")
    x = torch.tensor(ids.reshape(B, T), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1)).item()
    ev = ash.evaluate(ck, ids, seq_len=T, batch=B, precision="double")
    assert abs(ev["loss"] - ref) <= RTOL * ref, (ev, ref)
    if precision == "float":  # the F32 folder holds the float model exactly: the F64 export's parameters,
        # bit for bit, and so its logits. Those are compared within 1e-12 of their scale, not bit for bit:
        # two separately built torch models may take different CPU kernels (1.1e-16 apart on one VM).
        run_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "hf64", "--dtype", "double")
        wide = f64(transformers.MambaForCausalLM.from_pretrained(tmp_path / "hf64"))
        sw, sn = wide.state_dict(), model.state_dict()
        assert sorted(sw) == sorted(sn) and all(torch.equal(sw[k], sn[k]) for k in sw)
        with torch.no_grad():
            got = wide(input_ids=x).logits
        assert (got - logits).abs().max().item() <= 1e-12 * max(1.0, logits.abs().max().item())


def test_export_refuses_an_ssm_resnet(tmp_path, ash_cli):
    ck = tmp_path / "r.h5"
    run_cli(ash_cli, "init", "--out", ck, "--set", "model.vocab=20", "--set", "model.width=4",
            "--set", "model.state=2", "--set", "model.layers=1")
    rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "hf")
    assert rc == 2 and "ssm-resnet" in err and "model.arch = mamba" in err, err
    assert not (tmp_path / "hf").exists()


def test_outputs_may_not_replace_inputs(tmp_path, ash_cli):
    src = saved(hf_model(11, 5, 3, 1, 2, 2, 1, True, 1e-5, seed=2), tmp_path / "src", torch.float32)
    before = (src / "model.safetensors").read_bytes()
    rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", src / "model.safetensors")
    assert rc == 2 and "model.safetensors" in err, err
    assert (src / "model.safetensors").read_bytes() == before
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "import-hf", "--from", src, "--out", ck)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "model.safetensors").symlink_to(ck)
    rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "d")
    assert rc == 2 and "--checkpoint" in err, err
    # a link where export-hf writes a file is refused (docs/cli.md, Output files), its target untouched
    (tmp_path / "d" / "model.safetensors").unlink()
    (tmp_path / "d" / "config.json").symlink_to(tmp_path / "elsewhere.json")
    rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", tmp_path / "d")
    assert rc == 2 and "config.json' is a symbolic link" in err, err
    assert (tmp_path / "d" / "config.json").is_symlink() and not (tmp_path / "elsewhere.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp." in p.name) == []


def sharded(folder, model):
    """`model` saved as two shards and an index, as save_pretrained writes a large model."""
    return shard(saved(model, folder, torch.float32))


def shard(folder):
    """folder's model.safetensors replaced by two shards and an index."""
    t = load_tensors(folder)
    (folder / "model.safetensors").unlink()
    names = sorted(t)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        safetensors_numpy.save_file({k: t[k] for k in keys}, str(folder / shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def test_import_never_replaces_a_shard(tmp_path, ash_cli):
    """G1 (issue 45): every file import-hf reads is an input, each shard the index names
    included, by name, through a link or by a hard link; the CLI and import_hf alike."""
    src = sharded(tmp_path / "sh", hf_model(11, 5, 3, 2, 2, 2, 1, True, 1e-5, seed=5))
    files = {p.name: p.read_bytes() for p in src.iterdir()}
    shard = src / "model-00002-of-00002.safetensors"
    (tmp_path / "link.h5").symlink_to(shard)
    (tmp_path / "hard.h5").hardlink_to(src / "model-00001-of-00002.safetensors")
    for out in (shard, tmp_path / "link.h5", tmp_path / "hard.h5", src / "model.safetensors.index.json"):
        rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", out)
        assert rc == 2 and "is the same file as a file of --from" in err, (out, err)
        with pytest.raises(ash.Error, match="same file as a file of --from"):
            ash.import_hf(src, out)
    assert {p.name: p.read_bytes() for p in src.iterdir()} == files
    run_cli(ash_cli, "import-hf", "--from", src, "--out", src / "m.h5")  # a new file in the folder is fine
    assert ash.load(src / "m.h5").step == 0


def plant(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "socket":
        cwd = os.getcwd()  # a relative name: a socket's path is limited to 107 bytes
        os.chdir(path.parent)
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(path.name)
        finally:
            os.chdir(cwd)
    else:
        path.symlink_to(path.parent / "victim")
    return path


KINDS = {"fifo": "a FIFO", "directory": "a directory", "socket": "a socket", "link": "a symbolic link"}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_writers_refuse_non_regular_outputs(tmp_path, ash_cli, kind):
    """G2 (issue 45): import-hf, export-hf and save never rename over a FIFO, a socket, a
    directory or a link (nor write through it): exit 2 / ash.Error naming the path and what it is."""
    src = saved(hf_model(11, 5, 3, 1, 2, 2, 1, True, 1e-5, seed=7), tmp_path / "src", torch.float32)
    ck = tmp_path / "m.h5"
    run_cli(ash_cli, "import-hf", "--from", src, "--out", ck)
    out = plant(tmp_path / "out.h5", kind)
    rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", out)
    assert rc == 2 and f"'{out}' is {KINDS[kind]}" in err, err
    with pytest.raises(ash.Error, match=f"is {KINDS[kind]}"):
        ash.import_hf(src, out)
    with pytest.raises(ash.Error, match=f"is {KINDS[kind]}"):
        ash.save(out, ash.load(ck))
    for name in ("config.json", "model.safetensors"):
        d = tmp_path / f"hf_{name}"
        d.mkdir()
        plant(d / name, kind)
        rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", d)
        assert rc == 2 and f"'{d / name}' is {KINDS[kind]}" in err, err
        assert sorted(p.name for p in d.iterdir()) == [name]
    if kind != "directory":  # the folder itself: a folder is what export-hf writes
        rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", ck, "--out", out)
        assert rc == 2 and f"'{out}' is {KINDS[kind]}" in err, err
    assert not (tmp_path / "victim").exists()
    left = [p.name for p in tmp_path.rglob("*") if ".tmp." in p.name]
    assert left == [], left


def export_files(folder):
    return {n: (folder / n).read_bytes() for n in ("config.json", "model.safetensors")}


def test_export_is_one_step(tmp_path, ash_cli):
    """G5 (issue 45): export-hf killed or failing at any step leaves the complete previous export
    or the complete new one; a failure leaves no temporary file; other files in the folder stay."""
    run_cli(ash_cli, "init", "--out", tmp_path / "a.h5", "--set", "model.arch=mamba", "--set", "model.vocab=11",
            "--set", "model.width=4", "--set", "model.state=2", "--set", "model.layers=1")
    run_cli(ash_cli, "init", "--out", tmp_path / "b.h5", "--set", "model.arch=mamba", "--set", "model.vocab=11",
            "--set", "model.width=6", "--set", "model.state=2", "--set", "model.layers=2")
    for name in ("a", "b"):
        run_cli(ash_cli, "export-hf", "--checkpoint", tmp_path / f"{name}.h5", "--out", tmp_path / f"ref_{name}")
    old, new = export_files(tmp_path / "ref_a"), export_files(tmp_path / "ref_b")
    # The natural failure of the old two-rename export: a directory where config.json goes (the
    # weights were replaced, then the config's rename failed). Refused before anything is written.
    d = tmp_path / "d"
    run_cli(ash_cli, "export-hf", "--checkpoint", tmp_path / "a.h5", "--out", d)
    (d / "config.json").unlink()
    (d / "config.json").mkdir()
    rc, err = fail_cli(ash_cli, "export-hf", "--checkpoint", tmp_path / "b.h5", "--out", d)
    assert rc == 2 and "is a directory" in err, err
    assert (d / "model.safetensors").read_bytes() == old["model.safetensors"]
    for point in ("export:staged", "export:carried", "export:swapped"):
        for how in ("kill", "error"):
            if point == "export:swapped" and how == "error":
                continue  # after the swap nothing fails but moving a subfolder back (its own message)
            d = tmp_path / f"{point[7:]}_{how}"
            run_cli(ash_cli, "export-hf", "--checkpoint", tmp_path / "a.h5", "--out", d)
            (d / "README.md").write_text("mine")
            (d / "sub").mkdir()
            (d / "sub" / "x").write_text("kept")
            env = dict(os.environ, ASH_TEST_FAULT=point + (":error" if how == "error" else ""))
            r = subprocess.run([ash_cli, "export-hf", "--checkpoint", str(tmp_path / "b.h5"), "--out", str(d)],
                               capture_output=True, text=True, env=env)
            got = export_files(d)
            assert (d / "README.md").read_text() == "mine", point
            if how == "error":
                assert r.returncode == 2 and "injected failure" in r.stderr, r.stderr
                assert got == old and (d / "sub" / "x").read_text() == "kept"
                left = [p.name for p in tmp_path.iterdir() if ".tmp." in p.name or ".old." in p.name]
                assert left == [], left
            else:
                assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr)
                assert got == (new if point == "export:swapped" else old), point
                if point != "export:swapped":
                    assert (d / "sub" / "x").read_text() == "kept"
                for p in tmp_path.iterdir():  # what a kill may leave: a sibling folder to remove
                    if p.name.startswith(f".{d.name}.tmp."):
                        shutil.rmtree(p)
            run_cli(ash_cli, "export-hf", "--checkpoint", tmp_path / "b.h5", "--out", d)  # and it goes on
            assert export_files(d) == new and (d / "README.md").read_text() == "mine"
            back = tmp_path / f"back_{point[7:]}_{how}.h5"
            run_cli(ash_cli, "import-hf", "--from", d, "--out", back, "--precision", ash.load(tmp_path / "b.h5").precision)
            a, b = ash.load(tmp_path / "b.h5"), ash.load(back)
            assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def hostile(tmp_path, name, mutate):
    """A valid exported folder, then `mutate(folder)`."""
    src = saved(hf_model(11, 5, 3, 2, 2, 2, 1, True, 1e-5, seed=9), tmp_path / name, torch.float32)
    mutate(src)
    return src


def rewrite(folder, change):
    t = load_tensors(folder)
    change(t)
    safetensors_numpy.save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})


def truncate(folder):
    p = folder / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-7])


def huge_header(folder):
    p = folder / "model.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + p.read_bytes()[8:])


def wrong_shape(t):
    t["backbone.layers.1.mixer.x_proj.weight"] = t["backbone.layers.1.mixer.x_proj.weight"][:, :-1].copy()


def unexpected(t):
    t["backbone.layers.0.mixer.extra"] = np.zeros(3, np.float32)


def untied_head_in_tied_config(t):
    t["lm_head.weight"] = t["backbone.embeddings.weight"] + 1


def bad_config(folder):
    c = json.loads((folder / "config.json").read_text())
    c["intermediate_size"] = 7
    (folder / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("case,mutate,needle", [
    ("truncated", truncate, "model.safetensors"),
    ("huge_header", huge_header, "header"),
    ("wrong_shape", lambda f: rewrite(f, wrong_shape), "backbone.layers.1.mixer.x_proj.weight"),
    ("missing", lambda f: rewrite(f, lambda t: t.pop("backbone.layers.1.mixer.D")), "backbone.layers.1.mixer.D"),
    ("unexpected", lambda f: rewrite(f, unexpected), "backbone.layers.0.mixer.extra"),
    ("tied_head_differs", lambda f: rewrite(f, untied_head_in_tied_config), "lm_head.weight"),
    ("bad_config", bad_config, "intermediate_size"),
    ("no_weights", lambda f: (f / "model.safetensors").unlink(), "model.safetensors"),
])
def test_hostile_folders_exit_2(tmp_path, ash_cli, case, mutate, needle):
    src = hostile(tmp_path, case, mutate)
    out = tmp_path / "m.h5"
    rc, err = fail_cli(ash_cli, "import-hf", "--from", src, "--out", out)
    assert rc == 2 and needle in err and err.startswith("ash: error:"), (rc, err)
    assert not out.exists()
    with pytest.raises(ash.Error, match=needle.replace(".", r"\.")):
        ash.import_hf(src, out)


def test_unknown_config_keys_are_a_note(tmp_path, ash_cli):
    src = saved(hf_model(11, 5, 3, 1, 2, 2, 1, True, 1e-5, seed=6), tmp_path / "src", torch.float32)
    c = json.loads((src / "config.json").read_text())
    c["my_own_key"] = 3
    (src / "config.json").write_text(json.dumps(c))
    out = run_cli(ash_cli, "import-hf", "--from", src, "--out", tmp_path / "m.h5")
    note = [line for line in out.splitlines() if line.startswith("note:")]
    assert len(note) == 1 and "my_own_key" in note[0], out
    assert ash.import_hf(src, tmp_path / "m2.h5")["ignored"] == ["my_own_key"]
