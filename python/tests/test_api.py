"""The numpy-level API against the ash tool: grad() bit for bit, the other entry
points, errors; and the layer stack's backward against finite differences."""
import json
import re

import h5py
import numpy as np
import pytest

import adjoint_sharding as ash
from adjoint_sharding import _core
from conftest import run_cli


@pytest.mark.parametrize("engine,extra,kw", [
    ("adjoint-exact", [], {}),
    ("adjoint-exact", ["--detach-inputs", "--truncate", "5"], {"detach_inputs": True, "truncate": 5}),
    ("backprop", [], {}),
    ("adjoint-exact", ["--set", "run.storage=bf16", "--set", "grad.layer_checkpoint=2"],
     {"storage": "bf16", "layer_checkpoint": 2}),
    ("adjoint-exact", ["--precision", "float"], {"precision": "float"}),
    # documents end at each token 3 (the separator as a JSON escape, bare on --set)
    ("adjoint-exact", ["--set", "data.separator=\\u0003"], {"set": ["data.separator=\\u0003"]}),
])
def test_grad_equals_ash_grad_bitwise(tiny_model, ash_cli, tmp_path, engine, extra, kw):
    ckpt, tokens, ids = tiny_model
    out = tmp_path / "g.h5"
    run_cli(ash_cli, "grad", "--checkpoint", ckpt, "--tokens", tokens, "--set", "data.seq_len=37",
            "--set", "data.batch=2", "--engine", engine, *extra, "--out", out)
    loss, grads = ash.grad(ckpt, ids, seq_len=37, batch=2, engine=engine, **kw)
    with h5py.File(out) as f:
        assert loss == f["/loss"][()]
        names = []
        f["/grad"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        assert sorted(names) == sorted(grads)
        for n in names:
            ref = f["/grad/" + n][...]
            assert grads[n].dtype == ref.dtype and grads[n].shape == ref.shape, n
            assert np.array_equal(grads[n], ref), n


def _grad_file(path):
    with h5py.File(path) as f:
        grads = {}
        f["/grad"].visititems(lambda n, o: grads.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset) else None)
        return f["/loss"][()], grads


@pytest.mark.parametrize("flags,kw", [
    ([], {}),  # the stored adjoint with T̄ = 5, detached, chunk 3
    (["--engine", "adjoint-exact"], {"engine": "adjoint-exact"}),  # the stored T̄ and detach kept
    (["--engine", "backprop", "--truncate", "0"], {"engine": "backprop", "truncate": 0}),
    (["--truncate", "7", "--chunk", "2"], {"truncate": 7, "chunk": 2}),
    (["--set", "grad.truncate=0", "--truncate", "6"], {"set": ["grad.truncate=0"], "truncate": 6}),  # flag wins
])
def test_stored_options_resolve_the_same_in_cli_and_python(tiny_model, ash_cli, tmp_path, flags, kw):
    """The one rule (ash::checkpoint_run_config): an option not given keeps the checkpoint's
    stored value, one given replaces it, after the key=value assignments; `ash grad` and
    grad() resolve a checkpoint with a stored non-default engine, window and chunk alike."""
    ckpt, tokens, ids = tiny_model
    ck = ash.load(ckpt)
    cfg = dict(ck.config)
    cfg["grad"] = dict(cfg["grad"], engine="adjoint", truncate=5, detach_inputs=True, chunk=3)
    cfg["data"] = dict(cfg["data"], seq_len=37, batch=2)
    stored = tmp_path / "stored.h5"
    ash.save(stored, ck, config=cfg)
    out = tmp_path / "g.h5"
    printed = run_cli(ash_cli, "grad", "--checkpoint", stored, "--tokens", tokens, *flags, "--out", out)
    assert re.match(f"engine {kw.get('engine', 'adjoint')}[ (]", printed), printed
    loss, grads = ash.grad(stored, ids, **kw)
    ref_loss, ref = _grad_file(out)
    assert loss == ref_loss and sorted(grads) == sorted(ref)
    assert all(np.array_equal(grads[n], ref[n]) for n in ref)
    # the stored options count: the exact gradient (grad()'s former fixed defaults) is another one
    _, exact = ash.grad(stored, ids, engine="adjoint-exact", truncate=0, detach_inputs=False)
    assert any(not np.allclose(exact[n], ref[n], rtol=1e-6, atol=0) for n in ref)


def test_tokens_as_uint8_bytes_and_int64(tiny_model):
    ckpt, _, ids = tiny_model
    ref = ash.grad(ckpt, ids, seq_len=13)
    for t in (ids.astype(np.uint8), ids.astype(np.int64), bytes(ids.astype(np.uint8))):
        loss, g = ash.grad(ckpt, t, seq_len=13)
        assert loss == ref[0] and all(np.array_equal(g[k], ref[1][k]) for k in g)


def test_load_save_round_trip(tiny_model, ash_cli, tmp_path):
    ckpt, _, _ = tiny_model
    ck = ash.load(ckpt)
    assert ck.precision == "double" and ck.config["model"]["layers"] == 3
    assert ck["layers/002/A_log"].shape == (8, 4)
    ash.save(tmp_path / "copy.h5", ck, step=7)
    back = ash.load(tmp_path / "copy.h5")
    assert back.step == 7 and all(np.array_equal(back[k], ck[k]) for k in ck)
    assert "verified" in run_cli(ash_cli, "inspect", tmp_path / "copy.h5")


@pytest.mark.parametrize("precision,bad", [("double", np.nan), ("float", np.inf), ("double", -np.inf)])
def test_save_refuses_non_finite_parameters(tiny_model, ash_cli, tmp_path, precision, bad):
    """What every reader refuses is never written: ash.Error naming the tensor,
    no file (and no temporary file) left, a previous file unchanged."""
    ck = ash.load(tiny_model[0])
    out = tmp_path / "bad.h5"
    ck["layers/001/W_B"] = ck["layers/001/W_B"].copy()
    ck["layers/001/W_B"][2, 3] = bad
    with pytest.raises(ash.Error, match=r"/params/layers/001/W_B holds a non-finite value \((-?inf|nan) at index 19\)") as e:
        ash.save(out, ck, precision=precision)
    assert isinstance(e.value, ValueError) and str(out) in str(e.value)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    good = ash.load(tiny_model[0])
    ash.save(out, good, precision=precision)
    before = out.read_bytes()
    with pytest.raises(ash.Error, match="non-finite"):
        ash.save(out, ck, precision=precision)
    assert out.read_bytes() == before
    assert "values finite" in run_cli(ash_cli, "inspect", out)


def test_evaluate_generate_plan(tiny_model, ash_cli):
    ckpt, tokens, ids = tiny_model
    ev = ash.evaluate(ckpt, ids, seq_len=50, batch=2)
    printed = run_cli(ash_cli, "eval", "--checkpoint", ckpt, "--tokens", tokens, "--set", "data.seq_len=50",
                      "--set", "data.batch=2")
    assert f"{ev['loss']:.6f} nats/token" in printed and ev["targets"] == 400 - 8
    out = ash.generate(ckpt, [1, 2, 3], 20, temperature=0.0)
    assert out.shape == (20,) and out.max() < 17
    assert np.array_equal(out, ash.generate(ckpt, [1, 2, 3], 20, temperature=0.0))
    p = ash.plan({"model": {"width": 64, "layers": 2}, "data": {"seq_len": 1024, "batch": 2}}, "train")
    assert p["total"] == sum(p["items"].values()) and p["total"] > 0
    printed = run_cli(ash_cli, "plan", "--set", "model.width=64", "--set", "model.layers=2",
                      "--set", "data.seq_len=1024", "--set", "data.batch=2")
    assert p["table"].splitlines()[0] in printed


def test_evaluate_and_grad_share_the_tools_rules(tiny_model, ash_cli, tmp_path):
    """evaluate and grad are `ash eval` and `ash grad`'s library forms: the checkpoint's
    run.matmul is used (bf16 products round differently from fp32), and windows without
    a target are the tool's error, not a zero loss."""
    ckpt, tokens, ids = tiny_model
    ck = ash.load(ckpt)
    cfg = dict(ck.config)
    cfg["run"] = dict(cfg.get("run", {}), matmul="bf16", precision="float")
    bf16 = tmp_path / "bf16.h5"
    ash.save(bf16, ck, config=cfg, precision="float")
    ev = ash.evaluate(bf16, ids, seq_len=50, batch=2)
    printed = run_cli(ash_cli, "eval", "--checkpoint", bf16, "--tokens", tokens, "--set", "data.seq_len=50",
                      "--set", "data.batch=2")
    assert f"{ev['loss']:.6f} nats/token" in printed
    cfg["run"]["matmul"] = "fp32"
    fp32 = tmp_path / "fp32.h5"
    ash.save(fp32, ck, config=cfg, precision="float")
    assert ash.evaluate(fp32, ids, seq_len=50, batch=2)["loss"] != ev["loss"]
    # every token is 3, the separator: each one after a window's first starts a document
    threes = np.full(40, 3, dtype=np.uint32)
    with pytest.raises(ash.Error, match="the 1 window\\(s\\) of T=8 tokens hold no target"):
        ash.grad(ckpt, threes, seq_len=8, batch=1, set=["data.separator=\\u0003"])
    cfg["data"] = dict(cfg.get("data", {}), separator="\x03")
    sep = tmp_path / "sep.h5"
    ash.save(sep, ck, config=cfg, precision="float")
    with pytest.raises(ash.Error, match="the token array: its windows hold no target"):
        ash.evaluate(sep, threes, seq_len=8)


def test_train_with_progress(tmp_path):
    text = (b"the quick brown fox jumps over the lazy dog. " * 200)
    (tmp_path / "text.txt").write_bytes(text)
    lines = []
    cfg = {"model": {"width": 16, "state": 4, "layers": 2},
           "data": {"train": str(tmp_path / "text.txt"), "seq_len": 64, "batch": 2},
           "grad": {"engine": "adjoint-exact"},
           "optim": {"steps": 30, "warmup": 5, "lr": 1e-2},
           "run": {"out_dir": str(tmp_path / "run"), "log_every": 5, "eval_every": 15, "ckpt_every": 30}}
    s = ash.train(cfg, progress=lines.append)
    assert s["last_step"] == 30 and np.isfinite(s["last_loss"])
    assert any("step" in line for line in lines)
    ck = ash.load(s["checkpoint"])
    assert ck.step == 30


def test_train_progress_exception_is_raised(tmp_path):
    (tmp_path / "text.txt").write_bytes(b"abcdefgh" * 300)

    def boom(line):
        raise KeyError("stop here")

    cfg = {"model": {"width": 8, "state": 2, "layers": 1},
           "data": {"train": str(tmp_path / "text.txt"), "seq_len": 32, "batch": 1},
           "optim": {"steps": 4, "warmup": 1}, "run": {"out_dir": str(tmp_path / "run"), "log_every": 1}}
    with pytest.raises(KeyError, match="stop here"):
        ash.train(cfg, progress=boom)


@pytest.mark.parametrize("call,needle", [
    (lambda c, t: ash.grad(c, t, seq_len=10_000, batch=1), "need 10000 tokens"),
    (lambda c, t: ash.grad(c, t.astype(np.float32), seq_len=13), "must hold integers"),
    (lambda c, t: ash.grad(c, t.reshape(20, 20), seq_len=13), "1-D array"),
    (lambda c, t: ash.grad(c, -t.astype(np.int64) - 1, seq_len=13), "negative"),
    (lambda c, t: ash.grad(c, t + 100, seq_len=13), ">= vocab"),
    (lambda c, t: ash.grad(c, t, seq_len=13, engine="magic"), "grad.engine"),
    (lambda c, t: ash.grad(c, t, seq_len=13, engine="adjoint-exact", truncate=4), "detach"),
    (lambda c, t: ash.grad(c, t, seq_len=13, storage="int8"), "run.storage"),
    (lambda c, t: ash.grad(c, t, seq_len=13, precision="half"), "precision"),
    (lambda c, t: ash.grad("/nonexistent/x.h5", t, seq_len=13), "x.h5"),
    (lambda c, t: ash.evaluate(c, t[:1], seq_len=13), "nothing to predict"),
    (lambda c, t: ash.plan({"model": {"width": 0}}), "model.width"),
    # as the CLI (issue 35): negatives are refused, not read as "the checkpoint's"
    (lambda c, t: ash.grad(c, t, seq_len=13, layer_checkpoint=-1), "grad.layer_checkpoint must be"),
    (lambda c, t: ash.grad(c, t, seq_len=13, token_block=-1), "grad.token_block must be"),
    (lambda c, t: ash.generate(c, "a", 2**40), "n must be in [0, 2^30]"),
    (lambda c, t: ash.generate(c, "a", -1), "n must be in [0, 2^30]"),
])
def test_errors_are_ash_errors_with_the_cli_message(tiny_model, ash_cli, call, needle):
    ckpt, _, ids = tiny_model
    with pytest.raises(ash.Error, match=None) as e:
        call(ckpt, ids)
    assert needle in str(e.value), str(e.value)
    assert isinstance(e.value, ValueError) and "\n" not in str(e.value)


def test_error_text_is_the_cli_text(tiny_model, ash_cli, tmp_path):
    ckpt, tokens, ids = tiny_model
    with pytest.raises(ash.Error) as e:
        ash.grad(ckpt, ids, seq_len=13, batch=1, engine="adjoint-exact", truncate=4)
    r = __import__("subprocess").run([ash_cli, "grad", "--checkpoint", str(ckpt), "--tokens", str(tokens),
                                      "--set", "data.seq_len=13", "--set", "data.batch=1", "--engine",
                                      "adjoint-exact", "--truncate", "4", "--out", str(tmp_path / "g.h5")],
                                     capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"ash: error: {e.value}"


def _stack_params(ck):
    return {k: np.ascontiguousarray(v) for k, v in ck.items() if k.startswith("layers/")}


def _stack_opts(ck, **kw):
    o = _core.StackOptions()
    m = ck.config["model"]
    o.width, o.state, o.layers, o.chunk = m["width"], m["state"], m["layers"], 4
    for k, v in kw.items():
        setattr(o, k, v)
    return o


def test_stack_backward_matches_finite_differences(tiny_model):
    """L = <W, y_K(y_0, θ)>: the stack's gradient against central differences (float64)."""
    ck = ash.load(tiny_model[0])
    params, opts = _stack_params(ck), _stack_opts(ck)
    rng = np.random.default_rng(1)
    y0 = rng.standard_normal((2, 11, 8))
    W = rng.standard_normal((2, 11, 8))

    def L(p, y):
        yK = np.empty_like(y)
        _core.stack_forward(p, opts, y, yK)
        return float((W * yK).sum())

    g = W.copy()
    grads = _core.stack_backward(params, opts, y0, g)
    eps = 1e-6
    for idx in [(0, 0, 0), (1, 10, 7), (0, 5, 3)]:
        yp, ym = y0.copy(), y0.copy()
        yp[idx] += eps
        ym[idx] -= eps
        fd = (L(params, yp) - L(params, ym)) / (2 * eps)
        assert abs(fd - g[idx]) <= 1e-6 * max(1.0, abs(fd))
    for name in ["layers/000/W_delta", "layers/001/A_log", "layers/002/W_C", "layers/000/norm", "layers/002/D"]:
        flat = params[name].reshape(-1)
        for i in [0, flat.size - 1]:
            pp = {k: v.copy() for k, v in params.items()}
            pm = {k: v.copy() for k, v in params.items()}
            pp[name].reshape(-1)[i] += eps
            pm[name].reshape(-1)[i] -= eps
            fd = (L(pp, y0) - L(pm, y0)) / (2 * eps)
            got = grads[name].reshape(-1)[i]
            assert abs(fd - got) <= 1e-6 * max(1.0, abs(fd)), (name, i, fd, got)


def test_stack_refuses_bad_arrays(tiny_model):
    ck = ash.load(tiny_model[0])
    params, opts = _stack_params(ck), _stack_opts(ck)
    y0 = np.zeros((1, 5, 8))
    # each array is refused by its name, with what it is and where it must be (the build's device)
    here = rf"on {ash.device()} \(this build's device; Kokkos {ash.backend}\), got"
    with pytest.raises(ash.Error, match=rf"y0 must be a C-contiguous 3-D float32 array {here} a float16 array"):
        _core.stack_forward(params, opts, y0.astype(np.float16), np.zeros((1, 5, 8), np.float16))
    with pytest.raises(ash.Error, match=rf"y0 must be a C-contiguous 3-D float64 array {here} a float64 array of "
                                        r"shape \[2, 3, 8\]"):
        _core.stack_forward(params, opts, np.zeros((2, 5, 8))[:, ::2], np.zeros((2, 3, 8)))
    with pytest.raises(ash.Error, match=rf"yK must be a C-contiguous 3-D float64 array {here} a float32 array"):
        _core.stack_forward(params, opts, y0, np.zeros((1, 5, 8), np.float32))
    with pytest.raises(ash.Error, match=rf"g must be a C-contiguous 3-D float64 array {here} a list \(not an array\)"):
        _core.stack_backward(params, opts, y0, [0.0] * 40)
    with pytest.raises(ash.Error, match=rf"parameter 'layers/000/D' must be a C-contiguous float64 array {here}"):
        _core.stack_forward({**params, "layers/000/D": "text"}, opts, y0, np.zeros_like(y0))
    with pytest.raises(ash.Error, match="width P = 8"):
        _core.stack_forward(params, opts, np.zeros((1, 5, 7)), np.zeros((1, 5, 7)))
    with pytest.raises(ash.Error, match="missing"):
        _core.stack_forward({}, opts, y0, np.zeros_like(y0))
    with pytest.raises(ash.Error, match="shape"):
        _core.stack_forward({**params, "layers/000/D": np.zeros(3)}, opts, y0, np.zeros_like(y0))


def test_device_and_memory_peak(tiny_model):
    # a host Kokkos reads arrays in host memory; a CUDA build names its GPU
    if ash.backend in ("Serial", "OpenMP", "Threads"):
        assert ash.device() == "cpu"
    else:
        assert re.fullmatch(r"cuda:\d+", ash.device()), ash.device()
    ck = ash.load(tiny_model[0])
    y0 = np.zeros((1, 64, 8))
    _core.memory_reset_peak()
    before = max(_core.memory_peak().values(), default=0)
    _core.stack_forward(_stack_params(ck), _stack_opts(ck), y0, np.zeros_like(y0))
    assert max(_core.memory_peak().values()) > before  # the pass's own Views are counted


def test_init_too_big_is_the_cli_estimate():
    # `ash init`'s refusal with its estimate and plan table, not Kokkos' allocation error
    with pytest.raises(ash.Error, match="this configuration needs about .* of memory [(]init") as e:
        ash.init({"model": {"width": 100000, "state": 20000}})
    assert "total (predicted peak)" in str(e.value)


def test_stack_layout_validates_as_the_cli(tiny_model):
    ck = ash.load(tiny_model[0])
    assert len(_core.stack_layout(_stack_opts(ck))) == 7 * ck.config["model"]["layers"]
    for field, value, needle in (("layers", 2**32 + 2, "model.layers must be <="), ("width", -3, "model.width"),
                                 ("state", 0, "model.state"), ("vocab", 1, "model.vocab")):
        with pytest.raises(ash.Error, match=needle):
            _core.stack_layout(_stack_opts(ck, **{field: value}))


def test_two_imports_share_kokkos():
    import importlib
    import adjoint_sharding
    again = importlib.reload(adjoint_sharding)
    assert again.backend == adjoint_sharding._core.backend


def test_hostile_bytes_in_errors_are_quoted_printably(tiny_model, ash_cli, tmp_path):
    """Names and text read from a hostile file reach the tool's error and ash.Error as
    \\xNN (valid UTF-8 both), never as raw bytes: an HDF5 object whose name is not
    UTF-8, and a config.json holding such bytes (the JSON parser quotes what it read)."""
    ckpt, _, _ = tiny_model
    bad = tmp_path / "bad.h5"
    bad.write_bytes(open(ckpt, "rb").read())
    with h5py.File(bad, "r+") as f:
        f["params"].create_group(b"\xff\xfeev\x1bil")
    r = __import__("subprocess").run([ash_cli, "inspect", "--no-verify", str(bad)], capture_output=True)
    err = r.stderr.decode("utf-8")  # raises if a raw byte got through
    assert "\\xff\\xfeev\\x1bil" in err and "not part of the format" in err, err
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(b'{"model_type": "mamba\xff\xfe"}')
    r = __import__("subprocess").run([ash_cli, "import-hf", "--from", str(hf), "--out", str(tmp_path / "m.h5")],
                                     capture_output=True)
    err = r.stderr.decode("utf-8")
    assert r.returncode == 2 and "\\xff" in err, err
    with pytest.raises(ash.Error) as e:
        ash.import_hf(hf, tmp_path / "m.h5")
    assert "\\xff" in str(e.value), str(e.value)
