#!/usr/bin/env python3
"""Our Mamba (model.arch=mamba, E3 exact) against mamba-ssm's `Mamba` blocks, side by side.

The model is a stack of Mamba blocks as transformers' MambaForCausalLM lays it out
(docs/design.md §1, "The Mamba block"): embedding, K pre-norm residual blocks
h ← h + mixer(RMSNorm(h)), a final RMSNorm and the tied head, the loss the mean
cross-entropy of next-token targets. Theirs: each mixer is mamba-ssm 2.3.2.post1's
`mamba_ssm.modules.mamba_simple.Mamba` with use_fast_path=False (its CUDA
`selective_scan_fn`; the causal conv is F.conv1d unless causal-conv1d is installed, which
the rows record) and with its fast path (mamba_inner_fn) where causal-conv1d is
installed, RMSNorm and head eager PyTorch as transformers' slow path writes them.
Ours: `ash grad` (the check) and `ash_bench_grad --arch mamba` (the sweep), E3 exact.
Both use the parameters of one `ash init` checkpoint (copied tensor by tensor, by
transformers' names: docs/file_format.md) and the same tokens (torch_baseline's
synthetic ids, window b = ids [b·T, (b+1)·T), as ash_bench_grad makes them).

    mamba_block_vs_ash.py --out DIR [--build build | --ash ASH --bench BENCH] [--mamba-dir DIR]
                          [--width 256 --state 16 --layers 4 --vocab 256 --expand 2 --conv-kernel 4]
                          [--T 4096,8192,...] [--batch 1] [--check-T 2048 --check-batch 2]
                          [--reps 5] [--modes autograd,checkpoint,fast] [--max-seconds 30]
                          [--deadline S] [--quick] [--mutate | --mutate-sweep]

1. The check: loss and every parameter's gradient of theirs against `ash grad
   --engine adjoint-exact` at --check-T (exit 1 unless within --loss-rtol / --grad-rtol;
   max |difference| over the tensor's max |value|). --mutate reverses their conv taps
   (a wrong mapping on purpose: the smoke test's proof that the check can fail).
2. Their sweep (one process, batch --batch, T upward) by side_by_side.py's protocol, per
   T one row per mode of --modes: "autograd" (use_fast_path=False, plain autograd),
   "checkpoint" (the same with each block under torch.utils.checkpoint: the memory class
   of a gradient that keeps layer inputs only) and "fast" (use_fast_path=True: mamba-ssm's
   mamba_inner_fn with causal-conv1d's kernels; where causal_conv1d is not importable, or
   off CUDA, a row per T says the fast path was not available). Each point one untimed
   warm-up and --reps (5) steps timed by CUDA events, min and median; peak =
   torch.cuda.max_memory_allocated() (reset before each point). A mode ends at out of
   memory, or where its next T's warm-up and reps would pass --max-seconds, or at its
   share of the deadline.
3. Our sweep: one ash_bench_grad process per T (one warm-up, --reps timed gradients by its
   in-process timer, min and median), peak = the tool's "peak_total_bytes" (parameters,
   gradient buffers and tokens included, as torch's allocator counts them); ends as theirs
   does, at a failure (out of memory) or the deadline.
At every T both measured, the losses must agree within --sweep-loss-rtol: a row that does
not has "loss_ok": false, the table marks it and the script exits 1 (--mutate-sweep
reverses their conv taps in the sweep only, to show it).

Rows (every field named: side, mode, T, reps, min_s, median_s, peak_bytes, loss, loss_ok,
warm): OUT/rows.jsonl (the sides' own: OUT/ash.jsonl, OUT/mamba.jsonl); OUT/check.json;
the table (time and peak ratios to ours, longest T of each) in OUT/summary.md and on
stdout; every command in OUT/log.txt.
--deadline S: no measurement starts S seconds after the start (a GPU stage's budget).
--quick is the host smoke run: mamba-ssm's selective_scan_ref on the CPU at tiny sizes,
the plumbing and the check, not speed. Exit 1 on a failed check, a loss mismatch or no
measurement of either side.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import ash_row, definitions, mark_losses, read_rows, table, write_rows  # noqa: E402


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


def fast_path_missing(mamba_dir, need_cuda):
    """Why mamba-ssm's fast path (mamba_inner_fn: its fused conv + scan + projections, with
    causal-conv1d's CUDA kernels) cannot run here; None where it can. Mamba(use_fast_path=True)
    falls back to the slow path silently where causal_conv1d is missing, so it is asked first."""
    from mamba_ssm.ops import selective_scan_interface as ssi
    if not need_cuda:
        return "needs CUDA (mamba_inner_fn has no CPU form)"
    if ssi.causal_conv1d_fn is None or ssi.causal_conv1d_fwd_function is None:
        return "causal_conv1d is not importable"
    return None


def build_model(torch, Mamba, checkpoint, device, mutate=False):
    """(model, dims, names): the stack with the checkpoint's tensors; names maps our /params
    path to (parameter, reshape) so gradients compare by our names."""
    m, params = read_checkpoint(checkpoint, "mamba", "mamba_block_vs_ash")
    D, K, E, Kc = m["width"], m["layers"], m["expand"] * m["width"], m["conv_kernel"]
    R = m["dt_rank"] or -(-D // 16)
    model = stack_model(torch, m, device, lambda k: Mamba(
        d_model=D, d_state=m["state"], d_conv=Kc, expand=m["expand"], dt_rank=R, use_fast_path=False, layer_idx=k,
        device=device, dtype=torch.float32))
    names = stack_names(model, m)
    for k in range(K):
        mx, a = model.mixers[k], f"layers/{k:03d}/"
        names.update({a + "norm": (model.norms[k], None), a + "in_proj": (mx.in_proj.weight, None),
                      a + "conv_weight": (mx.conv1d.weight, (E, Kc)), a + "conv_bias": (mx.conv1d.bias, None),
                      a + "x_proj": (mx.x_proj.weight, None), a + "dt_proj": (mx.dt_proj.weight, None),
                      a + "dt_bias": (mx.dt_proj.bias, None), a + "A_log": (mx.A_log, None), a + "D": (mx.D, None),
                      a + "out_proj": (mx.out_proj.weight, None)})
    load_into(torch, model, names, params, device, mutate, "mamba_block_vs_ash")
    dims = {"vocab": m["vocab"], "width": D, "state": m["state"], "layers": K, "expand": m["expand"],
            "conv_kernel": Kc, "dt_rank": R, "tie_embeddings": bool(m["tie_embeddings"])}
    return model, dims, names


def read_checkpoint(checkpoint, arch, prog):
    """(model config, {our /params path: array}) of an ash checkpoint, which must be of model.arch arch."""
    import h5py
    import numpy as np
    with h5py.File(checkpoint, "r") as f:
        raw = f.attrs["config"]
        m = json.loads(raw.decode() if isinstance(raw, bytes) else raw)["model"]
        if m.get("arch") != arch:
            raise SystemExit(f"{prog}: {checkpoint} is not model.arch={arch} (model.arch={m.get('arch')})")
        return m, {name: np.asarray(f["params/" + name][...]) for name in _param_names(f)}


def stack_model(torch, m, device, mixer):
    """The stack as transformers' (Mamba|Mamba2)ForCausalLM lays it out, float32: embedding, K pre-norm
    residual blocks h <- h + mixer(k)(RMSNorm(h)), final RMSNorm, the head (tied unless the config
    says not); forward(x) is the mean next-token cross-entropy. .checkpoint: each block under
    torch.utils.checkpoint (mode "checkpoint")."""
    import torch.nn.functional as F
    V, D, K, eps = m["vocab"], m["width"], m["layers"], float(m["norm_eps"])

    def rms_norm(x, w):  # transformers' RMSNorm (float32 throughout here)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = torch.nn.Parameter(torch.empty(V, D, device=device))
            self.norms = torch.nn.ParameterList([torch.nn.Parameter(torch.empty(D, device=device)) for _ in range(K)])
            self.mixers = torch.nn.ModuleList([mixer(k) for k in range(K)])
            self.final_norm = torch.nn.Parameter(torch.empty(D, device=device))
            self.head = None if m["tie_embeddings"] else torch.nn.Parameter(torch.empty(V, D, device=device))
            self.checkpoint = False

        def block(self, h, k):
            return h + self.mixers[k](rms_norm(h, self.norms[k]))

        def forward(self, x):
            h = F.embedding(x, self.embedding)
            for k in range(K):
                h = torch.utils.checkpoint.checkpoint(self.block, h, k, use_reentrant=False) if self.checkpoint \
                    else self.block(h, k)
            logits = rms_norm(h, self.final_norm) @ (self.embedding if self.head is None else self.head).T
            return F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1))

    return Stack()


def stack_names(model, m):
    """Our names of the stack's own tensors (the blocks' are the caller's)."""
    names = {"embedding": (model.embedding, None), "final_norm": (model.final_norm, None)}
    if not m["tie_embeddings"]:
        names["head"] = (model.head, None)
    return names


def load_into(torch, model, names, params, device, mutate, prog):
    """Copies the checkpoint's tensors into the model by our names (every tensor of both, shapes
    checked; names[n] = (parameter, our shape or None)); mutate: the conv taps the wrong way round."""
    import numpy as np
    if sorted(names) != sorted(params) or sum(1 for _ in model.parameters()) != len(names):
        raise SystemExit(f"{prog}: the checkpoint's tensors {sorted(params)} are not the model's {sorted(names)}")
    with torch.no_grad():
        for name, (p, shape) in names.items():
            value = params[name]
            if name.endswith("conv_weight") and mutate:
                value = value[:, ::-1].copy()  # --mutate: the taps the wrong way round
            t = torch.from_numpy(np.ascontiguousarray(value)).to(device=device, dtype=torch.float32)
            if tuple(t.shape) != tuple(shape or p.shape):
                raise SystemExit(f"{prog}: /params/{name} has shape {tuple(t.shape)}, "
                                 f"the model's is {tuple(shape or p.shape)}")
            p.copy_(t.reshape(p.shape))


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
    return compare_with_ash(args, loss, names, {"mamba_ssm": version, "selective_scan_cuda": where, "conv": conv,
                                                "device": _device_name(torch, device), "torch": torch.__version__,
                                                **dims})


def compare_with_ash(args, loss, names, context):
    """Their loss and gradients (names: our /params path -> (parameter, ...)) against ash's gradient
    file args.ash_grad: OUT/check.json (with the context fields) and one line; 0 when within the
    tolerances, else 1."""
    import h5py
    import numpy as np
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
              "mutate": args.mutate, **context}
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
    """Their sweep (in a process of its own, so its allocator's memory is gone before ours runs):
    per T the modes of --modes, side_by_side's protocol."""
    import torch
    import torch.utils.checkpoint  # noqa: F401  (mode "checkpoint")
    sys.path.insert(0, HERE)
    from side_by_side import PEAK_TORCH, PROGRESS_HEAD, TIMER_TORCH_CPU, TIMER_TORCH_CUDA
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    Mamba, version, where, conv = import_mamba_module(args.mamba_dir, cuda)
    modes = args.modes.split(",")
    model, dims, _ = build_model(torch, Mamba, args.checkpoint, device, args.mutate_sweep)
    missing = fast_path_missing(args.mamba_dir, cuda) if "fast" in modes else None
    base = {"engine": "mamba-ssm Mamba", "scan": "selective_scan_fn" if cuda else "selective_scan_ref",
            "conv": conv, "mamba_ssm": version, "torch": torch.__version__, "device": _device_name(torch, device),
            "timer": TIMER_TORCH_CUDA if cuda else TIMER_TORCH_CPU, "peak": PEAK_TORCH if cuda else None,
            "batch": args.batch, **dims}
    print(f"# mamba-ssm {version} Mamba blocks (modes {args.modes}: autograd and checkpoint use_fast_path=False, "
          f"conv {conv}; fast: {missing or 'mamba_inner_fn + causal-conv1d'}; selective_scan_cuda: {where}); "
          f"torch {torch.__version__}, {base['device']}, float32; {dims}", flush=True)
    print(PROGRESS_HEAD, flush=True)
    return their_sweep(args, torch, device, model, dims["vocab"], base, modes, missing, "use_fast_path",
                       lambda fast: {"use_fast_path": fast, "conv": "causal_conv1d" if fast else conv})


def their_sweep(args, torch, device, model, vocab, base, modes, missing, fast_attr, extra):
    """side_by_side's sweep of the stack `model` (its .mixers, .checkpoint) per T and mode: the mode
    "fast" sets each mixer's fast_attr (read at each call: one model, one set of parameters), or,
    where missing says why it cannot run, one row per T says so; extra(fast) adds fields to a row.
    Rows go to OUT/mamba.jsonl with the fields of base."""
    from side_by_side import make_row, measure, print_row, sweep_modes, train_step
    cuda = device.type == "cuda"

    def point(T, mode):
        if mode == "fast" and missing:
            return make_row("mamba-ssm", mode, T, [], None, None, batch=args.batch, available=False,
                            note=f"fast path not available: {missing}")
        x = their_tokens(torch, T, args.batch, vocab, device)
        model.checkpoint = mode == "checkpoint"
        for mixer in model.mixers:
            setattr(mixer, fast_attr, mode == "fast")
        try:
            times, loss, peak = measure(torch, train_step(model, x), args.reps, cuda)
        finally:
            model.zero_grad(set_to_none=True)
            model.checkpoint = False
            for mixer in model.mixers:
                setattr(mixer, fast_attr, False)
        return make_row("mamba-ssm", mode, T, times, peak, loss, batch=args.batch, **extra(mode == "fast"))

    def emit(row):
        with open(os.path.join(args.out, "mamba.jsonl"), "a") as f:
            f.write(json.dumps({**base, **row}) + "\n")
        print_row(row)

    Ts = [int(t) for t in args.T.split(",")]
    if missing:  # one row per T says so; the other modes' series go on
        modes = [m for m in modes if m != "fast"]
        for T in Ts:
            emit(point(T, "fast"))
    sweep_modes(torch, Ts, modes, point, emit, args.reps, args.max_seconds, args.deadline, args.batch)
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


def summary(out, sweep_rtol, head_of, skipped=""):
    """The joined rows (OUT/rows.jsonl, loss_ok set) and table under head_of(check.json's fields) (or
    "no check ran" + skipped); returns the T at which the losses disagree."""
    rows = read_rows(os.path.join(out, "ash.jsonl")) + read_rows(os.path.join(out, "mamba.jsonl"))
    mismatched = mark_losses(rows, lambda r: r["T"], sweep_rtol)
    write_rows(os.path.join(out, "rows.jsonl"), rows)
    check = {}
    if os.path.exists(os.path.join(out, "check.json")):
        with open(os.path.join(out, "check.json")) as f:
            check = json.load(f)
    head = (head_of(check) + f"; check at T={check.get('T')}: {'passed' if check.get('passed') else 'FAILED'} "
            f"(loss {check.get('loss_rel_error', float('nan')):.1e}, gradients "
            f"{check.get('grad_worst_rel_error', float('nan')):.1e})") if check else "no check ran" + skipped
    longest = []
    for side, mode in sorted({(r["side"], r["mode"]) for r in rows}):
        Ts = [r["T"] for r in rows if (r["side"], r["mode"]) == (side, mode) and r.get("median_s") is not None]
        oom = [r["T"] for r in rows if (r["side"], r["mode"]) == (side, mode) and r.get("oom")]
        longest.append(f"{side} {mode} {max(Ts, default='-')}" + (f" (out of memory at {oom[0]})" if oom else ""))
    text = "\n".join([head, "", table(rows).rstrip("\n"), "", "Longest T measured: " + "; ".join(longest),
                      f"Losses at equal T {'agree' if not mismatched else 'DISAGREE at ' + str(mismatched)} "
                      f"(tolerance {sweep_rtol:g}).", "", definitions(sweep_rtol)])
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    return mismatched


def head_of_check(c):
    return (f"Mamba D={c.get('width')} N={c.get('state')} K={c.get('layers')} V={c.get('vocab')} "
            f"E={c.get('expand', 0) * (c.get('width') or 0)}, float; theirs: mamba-ssm {c.get('mamba_ssm')} Mamba "
            f"(autograd and checkpoint: use_fast_path=False, conv {c.get('conv')}; fast: use_fast_path=True), "
            f"{c.get('device')}")


def driver_args(ap, T, modes, mamba_dir_help):
    """The options the block scripts share (their model's sizes are their own)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--build", default="build", help="the ash build folder (a CUDA build on a GPU)")
    ap.add_argument("--ash", help="the ash executable (default: BUILD/src/ash)")
    ap.add_argument("--bench", help="ash_bench_grad (default: BUILD/perf_tests/ash_bench_grad)")
    ap.add_argument("--mamba-dir", help=mamba_dir_help)
    ap.add_argument("--T", default=T)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--check-T", type=int, default=2048)
    ap.add_argument("--check-batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per T on each side, after one warm-up")
    ap.add_argument("--modes", default="autograd,checkpoint,fast", help=modes)
    ap.add_argument("--max-seconds", type=float, default=30, help="per-point cap: warm-up + reps of one T")
    ap.add_argument("--deadline", type=float, default=0, help="start no measurement after this many seconds")
    ap.add_argument("--loss-rtol", type=float, default=1e-5)
    ap.add_argument("--grad-rtol", type=float, default=2e-3)
    ap.add_argument("--sweep-loss-rtol", type=float, default=1e-4, help="the two losses at every T measured")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    ap.add_argument("--quick", action="store_true",
                    help="host smoke run: mamba-ssm's references on the CPU, tiny sizes")
    ap.add_argument("--mutate", action="store_true", help="their conv taps reversed: the check must fail")
    ap.add_argument("--mutate-sweep", action="store_true",
                    help="their conv taps reversed in the sweep only: every T's losses must be flagged")
    ap.add_argument("--no-sweep", action="store_true", help="only the check")
    ap.add_argument("--role", choices=("check", "sweep"), help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    ap.add_argument("--ash-grad", help=argparse.SUPPRESS)


def drive(args, script, arch, sizes, child_extra=(), head_of=head_of_check, missing=None):
    """The driver (no CUDA in this process): `ash init` (model.arch=arch, model.<key>=<value> of sizes),
    the check, their sweep (script --role sweep), ours (ash_bench_grad --arch arch, sizes as flags),
    the summary. missing: why their side cannot run here (then ours runs alone). Returns the exit status."""
    name = os.path.basename(script)[:-3]
    os.makedirs(args.out, exist_ok=True)
    # this run's rows only
    for f in ("ash.jsonl", "mamba.jsonl", "rows.jsonl", "check.json", "log.txt", "summary.md"):
        if os.path.exists(os.path.join(args.out, f)):
            os.remove(os.path.join(args.out, f))
    log = os.path.join(args.out, "log.txt")
    ash = args.ash or os.path.join(args.build, "src", "ash")
    bench = args.bench or os.path.join(args.build, "perf_tests", "ash_bench_grad")
    t_start = time.monotonic()
    skipped = f": mamba-ssm's side skipped, {missing}" if missing else ""
    if missing:
        print(f"# {missing}: mamba-ssm's side (the check and their sweep) is skipped; ours runs alone", flush=True)

    def left():
        return max(1.0, args.deadline - (time.monotonic() - t_start)) if args.deadline else None

    def out_of_time(what):
        if args.deadline and time.monotonic() - t_start > args.deadline:
            print(f"# deadline ({args.deadline:.0f} s) reached: {what} and the rest not measured", flush=True)
            return True
        return False

    def done(rc):
        summary(args.out, args.sweep_loss_rtol, head_of, skipped)
        return rc

    ckpt = os.path.join(args.out, arch + ".h5")
    if run([ash, "init", "--precision", "float", "--out", ckpt, "--set", f"model.arch={arch}"] +
           [a for k, v in sizes.items() for a in ("--set", f"model.{k}={v}")], log, left()):
        return 1
    child = [sys.executable, os.path.abspath(script), "--out", args.out, "--checkpoint", ckpt, "--device",
             args.device, "--threads", str(args.threads), "--reps", str(args.reps), "--max-seconds",
             str(args.max_seconds), "--batch", str(args.batch), "--T", args.T, "--check-T", str(args.check_T),
             "--check-batch", str(args.check_batch), "--loss-rtol", str(args.loss_rtol), "--grad-rtol",
             str(args.grad_rtol), "--modes", args.modes] + list(child_extra) + \
        (["--mutate-sweep"] if args.mutate_sweep else []) + (["--mamba-dir", args.mamba_dir] if args.mamba_dir else [])

    # 1. the check: ash grad (E3) writes our loss and gradients, theirs compares in its own process
    if not missing:
        with tempfile.TemporaryDirectory() as tmp:
            ids, grad = os.path.join(tmp, "ids.u32"), os.path.join(tmp, "grad.h5")
            sys.path.insert(0, HERE)
            from torch_baseline import synthetic_ids
            synthetic_ids(args.check_batch * args.check_T, args.vocab).astype("<u4").tofile(ids)
            rc = run([ash, "grad", "--checkpoint", ckpt, "--tokens", ids, "--engine", "adjoint-exact", "--set",
                      f"data.seq_len={args.check_T}", "--set", f"data.batch={args.check_batch}", "--out", grad], log,
                     left())
            if rc == 0:
                rc = run(child + ["--role", "check", "--ash-grad", grad] + (["--mutate"] if args.mutate else []), log,
                         left())
        if rc != 0:
            done(1)
            print(f"{name}: the check against ash grad failed", file=sys.stderr)
            return 1
    if args.no_sweep:
        return done(0)

    # 2. theirs (runs out of memory first): at most half of what is left
    if not missing and not out_of_time("mamba-ssm's sweep"):
        share = max(1.0, left() / 2) if args.deadline else 0
        run(child + ["--role", "sweep", "--deadline", str(share)], log, share + 30 if share else None)
    # 3. ours: one process per T, so an out-of-memory ends the series and nothing else
    last = None
    for T in [int(t) for t in args.T.split(",")]:
        if out_of_time(f"ash E3 T={T}"):
            break
        if last and last["median_s"] * T / last["T"] * (args.reps + 1) > args.max_seconds:
            print(f"# ash E3 T={T}: about {last['median_s'] * T / last['T']:.1f} s a gradient, over the per-point cap "
                  f"of {args.max_seconds:g} s: T={T} and up not measured", flush=True)
            break
        one = os.path.join(args.out, "ash_last.jsonl")  # the benchmark rewrites its --json file
        if os.path.exists(one):
            os.remove(one)
        cap = 2 * args.max_seconds + 30  # a point predicted under the cap that runs far over it is stopped
        run([bench, "--arch", arch, "--engines", "adjoint-exact", "--T", str(T), "--batch", str(args.batch),
             "--reps", str(args.reps), "--warmup", "1", "--precision", "float", "--json", one] +
            [a for k, v in sizes.items() for a in (f"--{k.replace('_', '-')}", str(v))], log,
            min(cap, left()) if args.deadline else cap)
        new = read_rows(one)
        if os.path.exists(one):
            os.remove(one)
        if not new:  # out of memory or another failure: the rest of the series is larger
            break
        last = ash_row(new[-1], "E3")
        with open(os.path.join(args.out, "ash.jsonl"), "a") as f:
            f.write(json.dumps(last) + "\n")
    mismatched = summary(args.out, args.sweep_loss_rtol, head_of, skipped)
    measured = {"ash": len(read_rows(os.path.join(args.out, "ash.jsonl"))),
                "mamba-ssm": len(read_rows(os.path.join(args.out, "mamba.jsonl")))}
    empty = [side for side, n in measured.items() if n == 0 and not (side == "mamba-ssm" and missing)]
    if empty:
        print(f"{name}: no measurement of {', '.join(empty)}", file=sys.stderr)
        return 1
    if mismatched:
        print(f"{name}: the losses disagree at T = {mismatched}", file=sys.stderr)
        return 1
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    driver_args(ap, ",".join(str(2**e) for e in range(12, 25)),
                "mamba-ssm's: autograd (use_fast_path=False), checkpoint (the same, each block under "
                "torch.utils.checkpoint), fast (use_fast_path=True: mamba_inner_fn + causal-conv1d)",
                "a folder with selective_scan_cuda*.so and mamba_ssm/ "
                "(perf_tests/gpu/mamba_link.py, perf_tests/mamba_build.sh)")
    ap.add_argument("--width", type=int, default=256, help="D")
    ap.add_argument("--state", type=int, default=16, help="N")
    ap.add_argument("--layers", type=int, default=4, help="K")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--dt-rank", type=int, default=0, help="0: ceil(D / 16)")
    args = ap.parse_args()
    if args.quick:
        args.width, args.state, args.layers, args.vocab, args.conv_kernel = 16, 4, 2, 64, 3
        args.T, args.check_T, args.check_batch, args.reps, args.device, args.threads = "64,128", 48, 2, 2, "cpu", 1
    if args.role == "check":
        return role_check(args)
    if args.role == "sweep":
        return role_sweep(args)
    return drive(args, __file__, "mamba", {"width": args.width, "state": args.state, "layers": args.layers,
                                           "vocab": args.vocab, "expand": args.expand,
                                           "conv_kernel": args.conv_kernel, "dt_rank": args.dt_rank})


if __name__ == "__main__":
    sys.exit(main())
