#!/usr/bin/env python3
"""The GPU user's baseline: the model of docs/design.md §1 with mamba-ssm's selective scan.

Every layer's scan is mamba-ssm's `selective_scan_fn` (its CUDA kernel: the state kept
on chip, recomputed in the backward); RMSNorm, the projections, the embedding and the
head are eager PyTorch (perf_tests/torch_baseline.py's SSMModel). Our layer is that
operator, argument for argument:

    ỹ = selective_scan_fn(u=ŷ, delta=Wδ ŷ, A=a, B=β, C=γ, D=D, delta_bias=bδ, delta_softplus=True)

with a = −exp(Alog) (mamba's A is the negative decay rate, exp(Δ·A) ∈ (0, 1) as our A^t)
and the layouts u, delta: [batch, P, T], A: [P, N], B = β, C = γ: [batch, N, T] (one group).

    mamba_baseline.py [--T 4096,16384,...] [--batch 1] [--checkpoint CKPT | --width/--state/--layers/--vocab]
                      [--scan cuda|ref] [--mamba-dir DIR] [--device cuda|cpu] [--reps 5]
                      [--modes autograd,checkpoint] [--kernel-T T,...]
                      [--check-ash ASH [--check-T T]] [--json FILE]

--scan cuda (the default) needs mamba-ssm's compiled extension `selective_scan_cuda`:
installed with the package, or built for one GPU architecture by
perf_tests/mamba_build.sh into --mamba-dir. --scan ref runs mamba-ssm's pure-PyTorch
`selective_scan_ref` of the same operator (a Python loop over T: for checking the
argument mapping on a host, not for timing). Only mamba-ssm's scan module is imported,
not the package's __init__ (which pulls in its Mamba blocks and huggingface_hub).

--check-ash ASH runs `ASH grad` (E3, adjoint-exact) on the checkpoint and the same tokens
at T = --check-T (default: the first --T) and exits 1 unless the loss agrees to
--loss-rtol and every parameter's gradient to --grad-rtol (max |difference| over the
tensor's max |value|). Needs --checkpoint.

The sweep follows perf_tests/side_by_side.py's protocol: per T and mode one untimed
warm-up, then --reps timed steps (zero_grad, forward, loss.backward()), each between two
torch.cuda.Event records (time.perf_counter on the CPU); min and median reported;
peak_bytes is torch.cuda.max_memory_allocated() over the point (reset before it, so the
parameters, gradients and tokens are in it). --modes: "autograd" (plain autograd) and
"checkpoint" (each layer under torch.utils.checkpoint, non-reentrant: the memory class of
a gradient that keeps layer inputs only), a row each per T. A T that does not fit is
reported as "out of memory" (JSON "oom": true) and ends that mode's sweep. --kernel-T
adds "kernel" rows: selective_scan_fn forward + backward alone on one layer's shapes
([1, P, T] u and delta, [1, N, T] B and C, D, delta_bias, softplus), random inputs, the
same timing. Tokens: torch_baseline's synthetic ids (window b is ids [b·T, (b+1)·T)),
which --write-tokens saves for `ash grad`.
"""
import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types

import h5py
import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from side_by_side import (PEAK_TORCH, PROGRESS_HEAD, TIMER_TORCH_CPU, TIMER_TORCH_CUDA, make_row,  # noqa: E402
                          measure, print_row, sweep_modes, train_step)
from torch_baseline import SSMModel, add_model_arguments, model_from_arguments, rms_norm, synthetic_ids  # noqa: E402


class _NoExtension(types.ModuleType):
    """Stands in for selective_scan_cuda where it is not built: --scan ref never calls it."""

    def __getattr__(self, name):
        raise AttributeError(f"{name}: mamba-ssm's selective_scan_cuda is not built here (perf_tests/mamba_build.sh)")


def import_mamba_scan(mamba_dir, need_cuda):
    """(selective_scan_fn, selective_scan_ref, version, where) from mamba-ssm's scan module."""
    if mamba_dir:
        root = os.path.join(os.path.abspath(mamba_dir), "mamba_ssm")
        sys.path.insert(0, os.path.abspath(mamba_dir))  # selective_scan_cuda*.so of mamba_build.sh
    else:
        spec = importlib.util.find_spec("mamba_ssm")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("mamba_baseline: mamba_ssm is not importable (pip install mamba-ssm, "
                             "or perf_tests/mamba_build.sh and --mamba-dir)")
        root = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(root, "ops", "selective_scan_interface.py")):
        raise SystemExit(f"mamba_baseline: {root} has no ops/selective_scan_interface.py")
    with open(os.path.join(root, "__init__.py")) as f:
        match = re.search(r'^__version__\s*=\s*"([^"]+)"', f.read(), re.MULTILINE)
    version = match.group(1) if match else "unknown"
    # The package without its __init__: a namespace over the same directory.
    pkg = types.ModuleType("mamba_ssm")
    pkg.__path__ = [root]
    pkg.__version__ = version
    sys.modules["mamba_ssm"] = pkg
    try:
        import selective_scan_cuda  # noqa: F401
        where = getattr(selective_scan_cuda, "__file__", "?")
    except ImportError as e:
        if need_cuda:
            raise SystemExit(f"mamba_baseline: --scan cuda needs selective_scan_cuda ({e}); "
                             "build it with perf_tests/mamba_build.sh and pass --mamba-dir")
        sys.modules["selective_scan_cuda"] = _NoExtension("selective_scan_cuda")
        where = "not built"
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn, selective_scan_ref
    return selective_scan_fn, selective_scan_ref, version, where


class MambaSSMModel(SSMModel):
    """SSMModel with each layer's scan and readout done by one mamba-ssm selective scan."""

    def __init__(self, *args, scan, skip_D=False):
        super().__init__(*args, chunk=1)
        self.scan = scan
        self.skip_D = skip_D  # True only for --mutate: the check must then fail
        self.checkpoint = False  # each layer under torch.utils.checkpoint (mode "checkpoint")

    def forward(self, x):
        if not self.checkpoint:
            return super().forward(x)
        y = self["embedding"][x]
        for k in range(self.layers):  # only the layer inputs kept; each layer recomputed in the backward
            y = torch.utils.checkpoint.checkpoint(self.layer, y, k, use_reentrant=False)
        logits = rms_norm(y, self["final_norm"]) @ self["head"].T
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), x[:, 1:].reshape(-1))

    def layer(self, y, k):
        L = f"layers/{k:03d}/"
        yh = rms_norm(y, self[L + "norm"])                                     # ŷ  [B, T, P]
        u = yh.transpose(1, 2).contiguous()                                    # [B, P, T]
        delta = (yh @ self[L + "W_delta"].T).transpose(1, 2).contiguous()      # Wδ ŷ, bias in the scan
        beta = (yh @ self[L + "W_B"].T).transpose(1, 2).contiguous()           # β  [B, N, T]
        gamma = (yh @ self[L + "W_C"].T).transpose(1, 2).contiguous()          # γ  [B, N, T]
        a = -torch.exp(self[L + "A_log"])                                      # [P, N]
        D = None if self.skip_D else self[L + "D"]
        out = self.scan(u, delta, a, beta, gamma, D, delta_bias=self[L + "b_delta"],
                        delta_softplus=True)                                   # ỹ  [B, P, T]
        return y + out.transpose(1, 2)


def tokens(T, batch, vocab, device):
    ids = synthetic_ids(batch * T, vocab).astype(np.int64).reshape(batch, T)
    return torch.from_numpy(ids).to(device)


def check_against_ash(model, ash, checkpoint, T, batch, loss_rtol, grad_rtol, device):
    """Loss and every gradient of one step against `ash grad` on the same tokens; True if all agree."""
    x = tokens(T, batch, model.vocab, device)
    model.zero_grad(set_to_none=True)
    loss = model(x)
    loss.backward()
    with tempfile.TemporaryDirectory() as tmp:
        ids, out = os.path.join(tmp, "ids.u32"), os.path.join(tmp, "grad.h5")
        synthetic_ids(batch * T, model.vocab).astype("<u4").tofile(ids)
        cmd = [ash, "grad", "--checkpoint", checkpoint, "--tokens", ids, "--engine", "adjoint-exact",
               "--set", f"data.seq_len={T}", "--set", f"data.batch={batch}", "--out", out]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"mamba_baseline: {' '.join(cmd)} exited {run.returncode}:\n{run.stderr}")
        with h5py.File(out, "r") as f:
            ash_loss = float(f["/loss"][()])
            ash_grads = {name: f["/grad/" + name][...] for name in model.shapes}
    ok = True
    loss_err = abs(loss.item() - ash_loss) / abs(ash_loss)
    print(f"# check T={T} batch={batch}: loss {loss.item():.9g} (ash {ash_loss:.9g}), rel. error {loss_err:.2e}"
          f" (tolerance {loss_rtol:g})")
    ok &= loss_err <= loss_rtol
    worst = (0.0, "")
    for name, ref in ash_grads.items():
        g = model[name].grad
        ours = g.detach().double().cpu().numpy() if g is not None else np.zeros_like(ref)
        scale = float(np.max(np.abs(ref)))
        err = float(np.max(np.abs(ours - ref))) / scale if scale > 0 else float(np.max(np.abs(ours)))
        err = err if np.isfinite(err) else float("inf")
        worst = max(worst, (err, name))
        if not err <= grad_rtol:
            print(f"#   /grad/{name}: rel. max error {err:.2e} > {grad_rtol:g}")
            ok = False
    print(f"# gradients: worst rel. max error {worst[0]:.2e} ({worst[1]}), tolerance {grad_rtol:g}")
    model.zero_grad(set_to_none=True)
    return ok


def run(model, T, batch, reps, device, mode):
    """One point of the sweep: a side_by_side row (side mamba-ssm, the mode)."""
    cuda = device.type == "cuda"
    x = tokens(T, batch, model.vocab, device)
    model.checkpoint = mode == "checkpoint"
    try:
        times, loss, peak = measure(torch, train_step(model, x), reps, cuda)
    finally:
        model.zero_grad(set_to_none=True)
        model.checkpoint = False
    med = statistics.median(times)
    return make_row("mamba-ssm", mode, T, times, peak, loss, batch=batch, us_per_token=1e6 * med / (batch * T))


def run_kernel(scan, P, N, T, reps, device):
    """selective_scan_fn forward + backward alone on one layer's shapes (batch 1, random inputs)."""
    cuda = device.type == "cuda"
    g = torch.Generator().manual_seed(T)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    u, delta, B, C = rnd(1, P, T), rnd(1, P, T), rnd(1, N, T), rnd(1, N, T)
    A, D, bias = -torch.rand(P, N, generator=g).to(device) - 0.5, rnd(P), rnd(P)
    ins = [t.requires_grad_() for t in (u, delta, A, B, C, D, bias)]
    dy = rnd(1, P, T)

    def step():
        for t in ins:
            t.grad = None
        scan(*ins[:6], delta_bias=ins[6], delta_softplus=True).backward(dy)

    times, _, peak = measure(torch, step, reps, cuda)
    return make_row("mamba-ssm", "kernel", T, times, peak, None, batch=1, width=P, state=N,
                    note=f"{scan.__name__} forward + backward alone")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="4096,16384", help="comma-separated context lengths")
    add_model_arguments(ap, width=256, layers=8)
    ap.add_argument("--scan", choices=("cuda", "ref"), default="cuda")
    ap.add_argument("--mamba-dir", help="output folder of perf_tests/mamba_build.sh")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per T (after one warm-up)")
    ap.add_argument("--modes", default="autograd,checkpoint",
                    help="comma-separated: autograd (plain), checkpoint (per-layer torch.utils.checkpoint)")
    ap.add_argument("--kernel-T", default="", help="comma-separated T of the kernel-only rows (none by default)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--check-ash", metavar="ASH", help="the ash tool: check loss and gradients against `ash grad`")
    ap.add_argument("--check-T", type=int, help="T of the check (default: the first --T)")
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--grad-rtol", type=float, default=2e-3)
    ap.add_argument("--no-sweep", action="store_true", help="no T sweep: the check and --kernel-T rows only")
    ap.add_argument("--mutate", action="store_true",
                    help="a wrong mapping on purpose (the skip term D ŷ left out): the smoke test's proof that the check "
                         "can fail")
    ap.add_argument("--max-seconds", type=float, default=0,
                    help="skip the rest of the sweep once the next T's reps would take longer (0: no limit)")
    ap.add_argument("--json", help="append one JSON line per T to this file")
    ap.add_argument("--write-tokens", metavar="FILE.u32", help="write the first T's ids as a uint32 token file")
    args = ap.parse_args()
    Ts = [int(t) for t in args.T.split(",")]
    if min(Ts) < 2 or args.batch < 1 or args.reps < 1:
        ap.error("need T >= 2, batch >= 1 and reps >= 1")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("autograd", "checkpoint") for m in modes):
        ap.error(f"--modes {args.modes}: each of autograd, checkpoint")
    kernel_Ts = [int(t) for t in args.kernel_T.split(",") if t]
    if args.check_ash and not args.checkpoint:
        ap.error("--check-ash needs --checkpoint (ash grad reads the parameters from it)")
    if args.scan == "cuda" and args.device != "cuda":
        ap.error("--scan cuda runs on --device cuda; use --scan ref on the host")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU")
    if args.threads:
        torch.set_num_threads(args.threads)

    scan_fn, scan_ref, version, where = import_mamba_scan(args.mamba_dir, args.scan == "cuda")
    device = torch.device(args.device)
    scan = scan_fn if args.scan == "cuda" else scan_ref
    model, source = model_from_arguments(
        args, lambda *dims: MambaSSMModel(*dims, torch.float32, scan=scan, skip_D=args.mutate))
    model.to(device)
    if args.write_tokens:
        synthetic_ids(args.batch * Ts[0], model.vocab).astype("<u4").tofile(args.write_tokens)

    gpu = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"# mamba-ssm {version} selective_scan_{'fn' if args.scan == 'cuda' else 'ref'} "
          f"(selective_scan_cuda: {where}); torch {torch.__version__}, {gpu}, float32; "
          f"V={model.vocab} P={model.width} N={model.state} K={model.layers} batch={args.batch}; "
          f"parameters from {source}", flush=True)
    if args.check_ash:
        ok = check_against_ash(model, args.check_ash, args.checkpoint, args.check_T or Ts[0], args.batch,
                               args.loss_rtol, args.grad_rtol, device)
        if not ok:
            print("mamba_baseline: the mamba-ssm model does not match ash grad", file=sys.stderr)
            sys.exit(1)
    if args.no_sweep:
        Ts = []  # the check (and any kernel rows) only
    cuda = device.type == "cuda"
    base = {"engine": "mamba-ssm", "scan": args.scan, "mamba_ssm": version, "torch": torch.__version__,
            "device": gpu, "vocab": model.vocab, "width": model.width, "state": model.state,
            "layers": model.layers, "batch": args.batch, "timer": TIMER_TORCH_CUDA if cuda else TIMER_TORCH_CPU,
            "peak": PEAK_TORCH if cuda else None}
    print(PROGRESS_HEAD, flush=True)

    def emit(row):
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({**base, **row}) + "\n")
        print_row(row)

    sweep_modes(torch, Ts, modes, lambda T, mode: run(model, T, args.batch, args.reps, device, mode), emit,
                args.reps, args.max_seconds, batch=args.batch)
    for T in kernel_Ts:
        try:
            emit(run_kernel(scan, model.width, model.state, T, args.reps, device))
        except torch.cuda.OutOfMemoryError:
            emit(make_row("mamba-ssm", "kernel", T, [], None, None, batch=1, oom=True, note="out of memory"))
            break


if __name__ == "__main__":
    main()
