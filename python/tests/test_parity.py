"""The module refuses what the `ash` tool refuses (docs/python.md, "Errors"): each case runs
the tool's refusal (exit status 2) where the tool has one and the Python call beside it,
which must raise adjoint_sharding.Error naming the argument, before it allocates: under an
address-space limit of 1 GiB above what the process maps, so a check that came after
the allocation would fail here (MemoryError, bad_alloc) instead of growing the process."""
import contextlib
import fcntl
import resource
import subprocess

import numpy as np
import pytest

import adjoint_sharding as ash

torch = pytest.importorskip("torch", reason="torch is not installed in this venv (docs/python.md)")
from adjoint_sharding.torch import SSMStack  # noqa: E402


def mapped_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def headroom(extra=1 << 30):
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = mapped_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture
def model(tmp_path):
    ck = ash.init({"model": {"vocab": 17, "width": 8, "state": 4, "layers": 2}}, "double")
    path = tmp_path / "m.h5"
    ash.save(path, ck)
    tokens = tmp_path / "t.u32"
    (np.arange(200) % 17).astype("<u4").tofile(tokens)
    return path, tokens, ck


def cli_refuses(cli, *args):
    r = subprocess.run([cli, *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 2, (args, r.returncode, r.stdout, r.stderr)
    return r.stderr


def python_refuses(call, needle):
    with headroom():
        with pytest.raises(ash.Error) as e:
            call()
    assert needle in str(e.value), str(e.value)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_save_into_a_locked_run_folder(model, ash_cli, tmp_path):
    ckpt, tokens, ck = model
    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "a+") as lock:  # the lock `ash train` holds for its run folder
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert "in use by another ash train" in cli_refuses(ash_cli, "init", "--out", run / "m.h5")
        assert "in use by another ash train" in cli_refuses(ash_cli, "grad", "--checkpoint", ckpt, "--tokens", tokens,
                                                            "--set", "data.seq_len=8", "--out", run / "g.h5")
        python_refuses(lambda: ash.save(run / "m.h5", ck), "in use by another ash train")
    assert sorted(p.name for p in run.iterdir()) == [".lock"]
    ash.save(run / "m.h5", ck)  # the lock released: written


def test_save_with_a_negative_step(model, tmp_path):
    _, _, ck = model
    python_refuses(lambda: ash.save(tmp_path / "s.h5", ck, step=-1), "step")
    python_refuses(lambda: ash.save(tmp_path / "s.h5", ck, step=2**63), "step")
    assert not (tmp_path / "s.h5").exists()


def test_save_with_an_unknown_tensor(model, tmp_path):
    _, _, ck = model
    params = dict(ck)
    params["layers/000/W_bogus"] = np.zeros((8, 8))
    python_refuses(lambda: ash.save(tmp_path / "u.h5", params, config=ck.config), "'layers/000/W_bogus'")
    assert not (tmp_path / "u.h5").exists()


def test_init_with_a_duplicate_key(ash_cli, tmp_path):
    text = '{"model": {"width": 8, "width": 16, "state": 4, "layers": 1}}'
    (tmp_path / "dup.json").write_text(text)
    assert "duplicate key 'width'" in cli_refuses(ash_cli, "init", "--config", tmp_path / "dup.json",
                                                  "--out", tmp_path / "d.h5")
    python_refuses(lambda: ash.init(text), "duplicate key 'width'")


@pytest.mark.parametrize("flags,call,needle", [
    (["generate", "--prompt", "a", "--seed", "-1"], lambda c, t: ash.generate(c, "a", 2, seed=-1), "seed"),
    (["generate", "--prompt", "a", "--tokens", str(2**64)], lambda c, t: ash.generate(c, "a", 2**64), "n must"),
    (["grad", "--set", f"data.seq_len={2**64}"], lambda c, t: ash.grad(c, t, seq_len=2**64), "seq_len"),
    (["grad", "--engine", "adjoint-exact", "--truncate", str(2**63)],
     lambda c, t: ash.grad(c, t, seq_len=8, engine="adjoint-exact", truncate=2**63), "truncate"),
    (["eval", "--set", "data.batch=-1"], lambda c, t: ash.evaluate(c, t, seq_len=8, batch=-1), "data.batch"),
    (["grad", "--chunk", "0"], lambda c, t: ash.grad(c, t, seq_len=8, chunk=0), "chunk"),
])
def test_out_of_range_integers(model, ash_cli, tmp_path, flags, call, needle):
    ckpt, tokens, _ = model
    verb, *rest = flags
    io = ["--tokens", tokens] if verb in ("grad", "eval") else []
    out = ["--out", tmp_path / "g.h5"] if verb == "grad" else []
    cli_refuses(ash_cli, verb, "--checkpoint", ckpt, *io, *rest, *out)
    python_refuses(lambda: call(ckpt, np.fromfile(tokens, "<u4")), needle)


@pytest.mark.parametrize("sets,make,needle", [
    (["model.width=8", "model.state=4", f"model.layers={2**32 + 2}"], lambda: SSMStack(8, 4, 2**32 + 2),
     "model.layers"),
    (["model.width=65536", "model.state=32768", "model.layers=1"], lambda: SSMStack(2**16, 2**15, 1), "2^31"),
    (None, lambda: SSMStack(8, 4, 2**63), "layers"),  # beyond 64 bits: no --set of it reaches the library
])
def test_stack_sizes_before_any_tensor(ash_cli, sets, make, needle):
    if sets is not None:
        assert needle in cli_refuses(ash_cli, "plan", *[a for s in sets for a in ("--set", s)])
    python_refuses(make, needle)


def test_stack_options_at_construction_and_set_options(model, ash_cli, tmp_path):
    ckpt, tokens, _ = model
    grad = [ash_cli, "grad", "--checkpoint", ckpt, "--tokens", tokens, "--set", "data.seq_len=8"]
    needs = "needs grad.detach_inputs"
    assert needs in cli_refuses(*grad, "--engine", "adjoint-exact", "--truncate", "3", "--out", tmp_path / "g.h5")
    python_refuses(lambda: SSMStack(8, 4, 1, truncate=3), needs)
    assert "run.storage" in cli_refuses(*grad, "--set", "run.storage=fp8", "--out", tmp_path / "g.h5")
    stack = SSMStack(8, 4, 1, detach_inputs=True, truncate=3, dtype=torch.float64)
    python_refuses(lambda: stack.set_options(storage="fp8"), "run.storage")
    python_refuses(lambda: stack.set_options(detach_inputs=False), needs)
    python_refuses(lambda: stack.set_options(chunk=2**64), "chunk")
    # a refused change leaves the stack as it was: it still runs
    assert stack._options.storage == "float" and stack._options.detach_inputs
    y0 = torch.rand(1, 5, 8, dtype=torch.float64, requires_grad=True)
    stack(y0).sum().backward()
    assert y0.grad is not None and torch.isfinite(y0.grad).all()
