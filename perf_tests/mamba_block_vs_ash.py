#!/usr/bin/env python3
"""Our Mamba (model.arch=mamba, E3 exact) against mamba-ssm's `Mamba` blocks, side by side.

The model is a stack of Mamba blocks as transformers' MambaForCausalLM lays it out
(docs/design.md §1, "The Mamba block"): embedding, K pre-norm residual blocks
h ← h + mixer(RMSNorm(h)), a final RMSNorm and the tied head, the loss the mean
cross-entropy of next-token targets. Theirs: each mixer is mamba-ssm 2.3.2.post1's
`mamba_ssm.modules.mamba_simple.Mamba` with use_fast_path=False (its CUDA
`selective_scan_fn`; the causal conv is F.conv1d unless causal-conv1d is installed, which
the rows record), RMSNorm and head eager PyTorch as transformers' slow path writes them.
Ours: `ash grad` (the check) and `ash_bench_grad --arch mamba` (the sweep), E3 exact.
Both use the parameters of one `ash init` checkpoint (copied tensor by tensor, by
transformers' names: docs/file_format.md) and the same tokens (torch_baseline's
synthetic ids, window b = ids [b·T, (b+1)·T), as ash_bench_grad makes them).

    mamba_block_vs_ash.py --out DIR [--build build | --ash ASH --bench BENCH] [--mamba-dir DIR]
                          [--width 256 --state 16 --layers 4 --vocab 256 --expand 2 --conv-kernel 4]
                          [--T 4096,8192,...] [--batch 1] [--check-T 2048 --check-batch 2]
                          [--reps 3] [--max-seconds 30] [--deadline S] [--quick] [--mutate]

1. The check: loss and every parameter's gradient of theirs against `ash grad
   --engine adjoint-exact` at --check-T (exit 1 unless within --loss-rtol / --grad-rtol;
   max |difference| over the tensor's max |value|). --mutate reverses their conv taps
   (a wrong mapping on purpose: the smoke test's proof that the check can fail).
2. Their sweep (one process, batch --batch, T upward): one warm-up and --reps timed
   forward + loss.backward(), median; peak = torch.cuda.max_memory_allocated() (reset
   before each T). Ends at out of memory, or where the next T's warm-up and reps would
   pass --max-seconds (the per-point cap), or at its share of the deadline.
3. Our sweep: one ash_bench_grad process per T (one warm-up, --reps timed gradients,
   median), peak = the tool's "peak_total_bytes" (parameters, gradient buffers and tokens
   included, as torch's allocator counts them); ends as theirs does, at a failure (out of
   memory) or the deadline.
At every T both measured, the two losses must agree within --sweep-loss-rtol.

Rows: OUT/ash.jsonl, OUT/mamba.jsonl; OUT/check.json; the joined table (time and peak
ratios, longest T of each) in OUT/summary.md and on stdout; every command in OUT/log.txt.
--deadline S: no measurement starts S seconds after the start (a GPU stage's budget).
--quick is the host smoke run: mamba-ssm's selective_scan_ref on the CPU at tiny sizes,
the plumbing and the check, not speed. Exit 1 on a failed check, a loss mismatch or no
measurement of either side.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


# --- theirs: mamba-ssm's Mamba blocks, stacked as MambaForCausalLM ---------------------------------

def import_mamba_module(mamba_dir, need_cuda):
    """mamba-ssm's Mamba class (without the package's __init__, as mamba_baseline imports the scan),
    the scan it calls, mamba-ssm's version, where selective_scan_cuda came from, the conv path."""
    sys.path.insert(0, HERE)
    from mamba_baseline import import_mamba_scan
    scan_fn, scan_ref, version, where = import_mamba_scan(mamba_dir, need_cuda)
    from mamba_ssm.modules import mamba_simple
    if not need_cuda:  # the host: mamba-ssm's pure-PyTorch reference of the same scan
        mamba_simple.selective_scan_fn = scan_ref
    conv = "causal_conv1d" if mamba_simple.causal_conv1d_fn is not None else "F.conv1d"
    return mamba_simple.Mamba, version, where, conv


def build_model(torch, Mamba, checkpoint, device, mutate=False):
    """(model, dims, names): the stack with the checkpoint's tensors; names maps our /params
    path to (parameter, reshape) so gradients compare by our names."""
    import h5py
    import numpy as np
    import torch.nn.functional as F

    with h5py.File(checkpoint, "r") as f:
        cfg = json.loads(f.attrs["config"].decode() if isinstance(f.attrs["config"], bytes) else f.attrs["config"])
        m = cfg["model"]
        if m.get("arch") != "mamba":
            raise SystemExit(f"mamba_block_vs_ash: {checkpoint} is not a Mamba (model.arch={m.get('arch')})")
        params = {name: np.asarray(f["params/" + name][...]) for name in _param_names(f)}
    V, D, N, K = m["vocab"], m["width"], m["state"], m["layers"]
    E, Kc = m["expand"] * D, m["conv_kernel"]
    R = m["dt_rank"] or -(-D // 16)
    eps, tied = float(m["norm_eps"]), bool(m["tie_embeddings"])

    def rms_norm(x, w):  # transformers' MambaRMSNorm (float32 throughout here)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    class MambaStack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Parameter(torch.empty(V, D, device=device))
            self.norms = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(D, device=device)) for _ in range(K)])
            self.mixers = torch.nn.ModuleList([
                Mamba(d_model=D, d_state=N, d_conv=Kc, expand=m["expand"], dt_rank=R, use_fast_path=False,
                      layer_idx=k, device=device, dtype=torch.float32) for k in range(K)])
            self.final_norm = torch.nn.Parameter(torch.empty(D, device=device))
            self.head = None if tied else torch.nn.Parameter(torch.empty(V, D, device=device))

        def forward(self, x):
            h = F.embedding(x, self.embedding)
            for k in range(K):
                h = h + self.mixers[k](rms_norm(h, self.norms[k]))
            logits = rms_norm(h, self.final_norm) @ (self.embedding if self.head is None else self.head).T
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))

    model = MambaStack()
    names = {"embedding": (model.embedding, None), "final_norm": (model.final_norm, None)}
    if not tied:
        names["head"] = (model.head, None)
    for k in range(K):
        mx, a = model.mixers[k], f"layers/{k:03d}/"
        names.update({a + "norm": (model.norms[k], None), a + "in_proj": (mx.in_proj.weight, None),
                      a + "conv_weight": (mx.conv1d.weight, (E, Kc)), a + "conv_bias": (mx.conv1d.bias, None),
                      a + "x_proj": (mx.x_proj.weight, None), a + "dt_proj": (mx.dt_proj.weight, None),
                      a + "dt_bias": (mx.dt_proj.bias, None), a + "A_log": (mx.A_log, None), a + "D": (mx.D, None),
                      a + "out_proj": (mx.out_proj.weight, None)})
    if sorted(names) != sorted(params) or sum(1 for _ in model.parameters()) != len(names):
        raise SystemExit(f"mamba_block_vs_ash: the checkpoint's tensors {sorted(params)} are not the model's "
                         f"{sorted(names)}")
    with torch.no_grad():
        for name, (p, shape) in names.items():
            value = params[name]
            if name.endswith("conv_weight") and mutate:
                value = value[:, ::-1].copy()  # --mutate: the taps the wrong way round
            t = torch.from_numpy(np.ascontiguousarray(value)).to(device=device, dtype=torch.float32)
            if tuple(t.shape) != tuple(shape or p.shape):
                raise SystemExit(f"mamba_block_vs_ash: /params/{name} has shape {tuple(t.shape)}, "
                                 f"the model's is {tuple(shape or p.shape)}")
            p.copy_(t.reshape(p.shape))
    dims = {"vocab": V, "width": D, "state": N, "layers": K, "expand": m["expand"], "conv_kernel": Kc,
            "dt_rank": R, "tie_embeddings": tied}
    return model, dims, names


def _param_names(f):
    out = []
    f["params"].visit(lambda n: out.append(n) if hasattr(f["params/" + n], "shape") else None)
    return out


def their_tokens(torch, T, batch, vocab, device):
    sys.path.insert(0, HERE)
    from torch_baseline import synthetic_ids
    ids = synthetic_ids(batch * T, vocab).astype("int64").reshape(batch, T)
    return torch.from_numpy(ids).to(device)


def role_check(args):
    """The check (in a process of its own): theirs' loss and gradients against OUR gradient file."""
    import h5py
    import numpy as np
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    Mamba, version, where, conv = import_mamba_module(args.mamba_dir, args.device == "cuda")
    model, dims, names = build_model(torch, Mamba, args.checkpoint, device, args.mutate)
    x = their_tokens(torch, args.check_T, args.check_batch, dims["vocab"], device)
    loss = model(x)
    loss.backward()
    with h5py.File(args.ash_grad, "r") as f:
        ash_loss = float(f["/loss"][()])
        worst, bad = (0.0, ""), []
        for name, (p, _) in names.items():
            ref = np.asarray(f["/grad/" + name][...], dtype=np.float64)
            theirs = p.grad.detach().double().cpu().numpy().reshape(ref.shape)
            scale = float(np.max(np.abs(ref)))
            err = float(np.max(np.abs(theirs - ref))) / scale if scale > 0 else float(np.max(np.abs(theirs)))
            err = err if np.isfinite(err) else float("inf")
            worst = max(worst, (err, name))
            if not err <= args.grad_rtol:
                bad.append(f"{name} {err:.2e}")
    loss_err = abs(loss.item() - ash_loss) / abs(ash_loss)
    ok = loss_err <= args.loss_rtol and not bad
    result = {"T": args.check_T, "batch": args.check_batch, "loss_mamba_ssm": loss.item(), "loss_ash": ash_loss,
              "loss_rel_error": loss_err, "loss_rtol": args.loss_rtol, "grad_worst_rel_error": worst[0],
              "grad_worst_tensor": worst[1], "grad_rtol": args.grad_rtol, "grad_failed": bad, "passed": bool(ok),
              "mutate": args.mutate, "mamba_ssm": version, "selective_scan_cuda": where, "conv": conv,
              "device": _device_name(torch, device), "torch": torch.__version__, **dims}
    with open(os.path.join(args.out, "check.json"), "w") as f:
        json.dump(result, f, indent=1)
    over = f"; over it ({len(bad)} tensors): {', '.join(bad[:6])}{', ...' if len(bad) > 6 else ''}" if bad else ""
    print(f"# check T={args.check_T} batch={args.check_batch}: loss {loss.item():.9g} (ash {ash_loss:.9g}), "
          f"rel. error {loss_err:.2e} (tolerance {args.loss_rtol:g}); gradients: worst rel. max error "
          f"{worst[0]:.2e} ({worst[1]}), tolerance {args.grad_rtol:g}{over}", flush=True)
    return 0 if ok else 1


def _device_name(torch, device):
    return torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def role_sweep(args):
    """Their sweep (in a process of its own, so its allocator's memory is gone before ours runs)."""
    import torch
    sys.path.insert(0, HERE)
    from torch_baseline import timed_steps
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    Mamba, version, where, conv = import_mamba_module(args.mamba_dir, cuda)
    model, dims, _ = build_model(torch, Mamba, args.checkpoint, device)
    base = {"engine": "mamba-ssm Mamba", "scan": "selective_scan_fn" if cuda else "selective_scan_ref",
            "conv": conv, "mamba_ssm": version, "torch": torch.__version__, "device": _device_name(torch, device),
            "batch": args.batch, **dims}
    print(f"# mamba-ssm {version} Mamba blocks (use_fast_path=False, conv {conv}, selective_scan_cuda: {where}); "
          f"torch {torch.__version__}, {base['device']}, float32; {dims}", flush=True)
    t_start, last = time.monotonic(), None
    for T in [int(t) for t in args.T.split(",")]:
        if args.deadline and time.monotonic() - t_start > args.deadline:
            print(f"{T:>9}  not measured: deadline", flush=True)
            break
        if last and last["seconds"] * T / last["T"] * (args.reps + 1) > args.max_seconds:
            print(f"{T:>9}  not measured: about {last['seconds'] * T / last['T']:.1f} s a step, over the "
                  f"per-point cap of {args.max_seconds:g} s", flush=True)
            break
        try:
            x = their_tokens(torch, T, args.batch, dims["vocab"], device)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            timed_steps(model, x, 1, cuda)  # warm-up
            times, loss = timed_steps(model, x, args.reps, cuda)
            med = statistics.median(times)
            row = last = {"T": T, "seconds": med, "best_seconds": min(times),
                          "us_per_token": 1e6 * med / (args.batch * T), "loss": loss.item(),
                          "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None}
        except torch.cuda.OutOfMemoryError:
            row = {"T": T, "oom": True}
        model.zero_grad(set_to_none=True)
        x = loss = None
        with open(os.path.join(args.out, "mamba.jsonl"), "a") as f:
            f.write(json.dumps({**base, **row}) + "\n")
        if row.get("oom"):
            print(f"{T:>9}  out of memory", flush=True)
            break
        peak = f"{row['peak_bytes'] / 2**20:.1f} MiB" if row["peak_bytes"] is not None else "-"
        print(f"{T:>9} {row['seconds']:>10.4f} s {row['us_per_token']:>10.3f} us/token  loss {row['loss']:.8g}  "
              f"peak {peak}", flush=True)
    return 0


# --- the driver: no CUDA in this process ------------------------------------------------------------

def run(cmd, log, timeout=None):
    print("$ " + " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        note = f"# stopped after {timeout:.0f} s (the per-point cap or the deadline)\n"
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n" + out + note)
        sys.stdout.write(out + note)
        return 124
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + r.stdout + r.stderr)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.stdout.write(r.stderr[-3000:])
    sys.stdout.flush()
    return r.returncode


def rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mib(b):
    return f"{b / 2**20:.1f}" if b else "-"


def summary(out, sweep_rtol):
    """The joined table; returns the T at which the two losses disagree."""
    a = {r["T"]: r for r in rows(os.path.join(out, "ash.jsonl"))}
    m = {r["T"]: r for r in rows(os.path.join(out, "mamba.jsonl")) if not r.get("oom")}
    oom = [r["T"] for r in rows(os.path.join(out, "mamba.jsonl")) if r.get("oom")]
    lines = ["| T | E3 s | mamba-ssm s | E3 / mamba time | E3 peak MiB | mamba peak MiB | E3 / mamba peak | "
             "loss E3 | loss mamba | rel. diff |", "|---|---|---|---|---|---|---|---|---|---|"]
    mismatched = []
    for T in sorted(set(a) | set(m)):
        ra, rm = a.get(T, {}), m.get(T, {})
        ta, tm, pa, pm = ra.get("seconds"), rm.get("seconds"), ra.get("peak_total_bytes"), rm.get("peak_bytes")
        la, lm = ra.get("loss"), rm.get("loss")
        diff = abs(la - lm) / abs(lm) if la is not None and lm is not None else None
        if diff is not None and not diff <= sweep_rtol:
            mismatched.append(T)
        lines.append(f"| {T} | {'-' if ta is None else f'{ta:.4f}'} | {'-' if tm is None else f'{tm:.4f}'} | "
                     f"{f'{ta / tm:.2f}' if ta and tm else '-'} | {mib(pa)} | {mib(pm)} | "
                     f"{f'{pa / pm:.3f}' if pa and pm else '-'} | {'-' if la is None else f'{la:.7f}'} | "
                     f"{'-' if lm is None else f'{lm:.7f}'} | {'-' if diff is None else f'{diff:.1e}'} |")
    la, lm = max(a, default=0), max(m, default=0)
    check = {}
    if os.path.exists(os.path.join(out, "check.json")):
        with open(os.path.join(out, "check.json")) as f:
            check = json.load(f)
    head = (f"Mamba D={check.get('width')} N={check.get('state')} K={check.get('layers')} "
            f"V={check.get('vocab')} E={check.get('expand', 0) * (check.get('width') or 0)}, float; theirs: "
            f"mamba-ssm {check.get('mamba_ssm')} Mamba (use_fast_path=False, conv {check.get('conv')}), "
            f"{check.get('device')}; check at T={check.get('T')}: "
            f"{'passed' if check.get('passed') else 'FAILED'} (loss {check.get('loss_rel_error', float('nan')):.1e}, "
            f"gradients {check.get('grad_worst_rel_error', float('nan')):.1e})") if check else "no check ran"
    text = "\n".join([head, ""] + lines + [
        "", f"Longest T measured: E3 {la}, mamba-ssm {lm}" + (f" (out of memory at {oom[0]})" if oom else "") +
        (f"; E3 / mamba-ssm {la / lm:.0f}x" if la and lm else ""),
        f"Losses at equal T {'agree' if not mismatched else 'DISAGREE at ' + str(mismatched)} "
        f"(tolerance {sweep_rtol:g})."]) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    return mismatched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--build", default="build", help="the ash build folder (a CUDA build on a GPU)")
    ap.add_argument("--ash", help="the ash executable (default: BUILD/src/ash)")
    ap.add_argument("--bench", help="ash_bench_grad (default: BUILD/perf_tests/ash_bench_grad)")
    ap.add_argument("--mamba-dir", help="a folder with selective_scan_cuda*.so and mamba_ssm/ "
                                        "(perf_tests/gpu/mamba_link.py, perf_tests/mamba_build.sh)")
    ap.add_argument("--width", type=int, default=256, help="D")
    ap.add_argument("--state", type=int, default=16, help="N")
    ap.add_argument("--layers", type=int, default=4, help="K")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--dt-rank", type=int, default=0, help="0: ceil(D / 16)")
    ap.add_argument("--T", default=",".join(str(2**e) for e in range(12, 25)))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--check-T", type=int, default=2048)
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per T, after one warm-up")
    ap.add_argument("--max-seconds", type=float, default=30, help="per-point cap: warm-up + reps of one T")
    ap.add_argument("--deadline", type=float, default=0, help="start no measurement after this many seconds")
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--grad-rtol", type=float, default=2e-3)
    ap.add_argument("--sweep-loss-rtol", type=float, default=1e-4, help="the two losses at every T measured")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true", help="host smoke run: selective_scan_ref on the CPU, tiny sizes")
    ap.add_argument("--mutate", action="store_true", help="their conv taps reversed: the check must fail")
    ap.add_argument("--no-sweep", action="store_true", help="only the check")
    ap.add_argument("--role", choices=("check", "sweep"), help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--ash-grad", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.width, args.state, args.layers, args.vocab, args.conv_kernel = 16, 4, 2, 64, 3
        args.T, args.check_T, args.check_batch, args.reps, args.device, args.threads = "64,128", 48, 2, 1, "cpu", 1
    if args.role == "check":
        return role_check(args)
    if args.role == "sweep":
        return role_sweep(args)

    os.makedirs(args.out, exist_ok=True)
    for name in ("ash.jsonl", "mamba.jsonl", "check.json", "log.txt", "summary.md"):  # this run's rows only
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    log = os.path.join(args.out, "log.txt")
    ash = args.ash or os.path.join(args.build, "src", "ash")
    bench = args.bench or os.path.join(args.build, "perf_tests", "ash_bench_grad")
    t_start = time.monotonic()

    def left():
        return max(1.0, args.deadline - (time.monotonic() - t_start)) if args.deadline else None

    def out_of_time(what):
        if args.deadline and time.monotonic() - t_start > args.deadline:
            print(f"# deadline ({args.deadline:.0f} s) reached: {what} and the rest not measured", flush=True)
            return True
        return False

    sizes = {"width": args.width, "state": args.state, "layers": args.layers, "vocab": args.vocab,
             "expand": args.expand, "conv_kernel": args.conv_kernel, "dt_rank": args.dt_rank}
    ckpt = os.path.join(args.out, "mamba.h5")
    if run([ash, "init", "--precision", "float", "--out", ckpt, "--set", "model.arch=mamba"] +
           [a for k, v in sizes.items() for a in ("--set", f"model.{k}={v}")], log, left()):
        return 1
    child = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--checkpoint", ckpt, "--device",
             args.device, "--threads", str(args.threads), "--reps", str(args.reps), "--max-seconds",
             str(args.max_seconds), "--batch", str(args.batch), "--T", args.T, "--check-T", str(args.check_T),
             "--check-batch", str(args.check_batch), "--loss-rtol", str(args.loss_rtol), "--grad-rtol",
             str(args.grad_rtol)] + (["--mamba-dir", args.mamba_dir] if args.mamba_dir else [])

    # 1. the check: ash grad (E3) writes our loss and gradients, theirs compares in its own process
    with tempfile.TemporaryDirectory() as tmp:
        ids, grad = os.path.join(tmp, "ids.u32"), os.path.join(tmp, "grad.h5")
        sys.path.insert(0, HERE)
        from torch_baseline import synthetic_ids
        synthetic_ids(args.check_batch * args.check_T, args.vocab).astype("<u4").tofile(ids)
        rc = run([ash, "grad", "--checkpoint", ckpt, "--tokens", ids, "--engine", "adjoint-exact", "--set",
                  f"data.seq_len={args.check_T}", "--set", f"data.batch={args.check_batch}", "--out", grad], log, left())
        if rc == 0:
            rc = run(child + ["--role", "check", "--ash-grad", grad] + (["--mutate"] if args.mutate else []), log,
                     left())
    if rc != 0:
        summary(args.out, args.sweep_loss_rtol)
        print("mamba_block_vs_ash: the check against ash grad failed", file=sys.stderr)
        return 1
    if args.no_sweep:
        summary(args.out, args.sweep_loss_rtol)
        return 0

    # 2. theirs (runs out of memory first): at most half of what is left
    if not out_of_time("mamba-ssm's sweep"):
        share = max(1.0, left() / 2) if args.deadline else 0
        run(child + ["--role", "sweep", "--deadline", str(share)], log, share + 30 if share else None)
    # 3. ours: one process per T, so an out-of-memory ends the series and nothing else
    last = None
    for T in [int(t) for t in args.T.split(",")]:
        if out_of_time(f"ash E3 T={T}"):
            break
        if last and last["seconds"] * T / last["T"] * (args.reps + 1) > args.max_seconds:
            print(f"# ash E3 T={T}: about {last['seconds'] * T / last['T']:.1f} s a gradient, over the per-point cap "
                  f"of {args.max_seconds:g} s: T={T} and up not measured", flush=True)
            break
        one = os.path.join(args.out, "ash_last.jsonl")  # the benchmark rewrites its --json file
        if os.path.exists(one):
            os.remove(one)
        cap = 2 * args.max_seconds + 30  # a point predicted under the cap that runs far over it is stopped
        run([bench, "--arch", "mamba", "--engines", "adjoint-exact", "--T", str(T), "--batch", str(args.batch),
             "--reps", str(args.reps), "--warmup", "1", "--precision", "float", "--json", one] +
            [a for k in ("width", "state", "layers", "vocab", "expand") for a in (f"--{k}", str(sizes[k]))] +
            ["--conv-kernel", str(args.conv_kernel), "--dt-rank", str(args.dt_rank)], log,
            min(cap, left()) if args.deadline else cap)
        new = rows(one)
        if os.path.exists(one):
            os.remove(one)
        if not new:  # out of memory or another failure: the rest of the series is larger
            break
        with open(os.path.join(args.out, "ash.jsonl"), "a") as f:
            f.write(json.dumps(new[-1]) + "\n")
        last = new[-1]
    mismatched = summary(args.out, args.sweep_loss_rtol)
    measured = [len(rows(os.path.join(args.out, f))) for f in ("ash.jsonl", "mamba.jsonl")]
    if min(measured) == 0:
        print(f"mamba_block_vs_ash: no measurement of {'ash' if measured[0] == 0 else 'mamba-ssm'}", file=sys.stderr)
        return 1
    if mismatched:
        print(f"mamba_block_vs_ash: the losses disagree at T = {mismatched}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
