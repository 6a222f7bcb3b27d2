#!/usr/bin/env python3
"""A Mamba-2's gradient on the CPU: our E3 against transformers, side by side (issue 43, item 5).

The same model two ways, float32, batch 1, one window of T tokens:

  hf   transformers' Mamba2ForCausalLM on the CPU: its pure-PyTorch path (the causal conv as
       F.conv1d, the SSD as mamba2_chunk_scan's chunked einsums, chunk_size 256), forward +
       loss.backward() under autograd. The script refuses to run if any of transformers'
       kernel hooks (mamba-ssm, causal-conv1d, hub kernels) would replace that path.
  ash  `ash grad --engine adjoint-exact` on the checkpoint `ash import-hf` made of the very
       folder transformers saved (identical weights), on the same tokens.

    mamba2_cpu_vs_hf.py [--T-list 4096,8192,...] [--threads N] [--timeout S] [--budget S]
                        [--reps R] [--json OUT.jsonl] [--ash build/src/ash] [--mem-cap GIB] [--work DIR]
                        [--width 256 --state 64 --head-dim 64 --n-groups 1 --layers 4 --vocab 256
                         --expand 2 --conv-kernel 4 --chunk-size 256] [--seed 0]
                        [--check-T 600] [--loss-rtol 1e-5] [--grad-rtol 1e-3] [--rtol 1e-4] [--mutate]

1. The check (before any timing): at --check-T (not a multiple of the chunk: transformers pads
   the last chunk) transformers' loss and every parameter's gradient against the gradient file
   of `ash grad --engine adjoint-exact`: the losses within --loss-rtol (relative) and, per
   tensor, max |theirs - ours| / max |ours| within --grad-rtol (both sides float32; float32's
   rounding over a K-block model is ~1e-5 of a tensor's largest entry). Exit 1 when over either.
2. The sweep: T upward, the two sides alternating (rep 0: hf then ash, rep 1: ash then hf, ...;
   this machine's timings vary run to run), each run a child process of its own so that its
   peak is its own, exactly as mamba_cpu_vs_hf.py (whose code runs it): `seconds` the gradient
   alone after loading (transformers: perf_counter around forward + backward; ash: the `time`
   line of `ash grad`), no warm-up (one gradient per process, as a training step's first);
   `peak` the child's VmHWM as it reads it itself (transformers' `base`: its RSS before the
   forward). Every finished run's loss must agree with the first of its T to --rtol.
   A run over --timeout or --mem-cap is killed and reported, and larger T of that side are
   not run; nor is a T whose extrapolated time or peak would pass them; --budget: no run
   starts after that many seconds of sweep.
--mutate (the smoke test's negative check): ash gets the model with its final norm scaled
by 1.1: the check must fail; with --no-check too, the sweep's loss check must fail.
Prints one markdown table at the end (and --json: one JSON object per run, the check first).
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from mamba_cpu_vs_hf import (common_args, measure, prepare, read_ids, run_child, save_model, sweep, table,  # noqa: E402
                             timed_gradient)

IMPLS = ("hf", "ash")
LABEL = {"hf": "transformers Mamba2 (torch path)", "ash": "ash E3"}
KERNEL_HOOKS = ("mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined", "causal_conv1d_fn", "causal_conv1d_update",
                "mamba2_selective_state_update")


def hf_config(a):
    from transformers import Mamba2Config
    return Mamba2Config(vocab_size=a.vocab, hidden_size=a.width, state_size=a.state, num_hidden_layers=a.layers,
                        expand=a.expand, conv_kernel=a.conv_kernel, head_dim=a.head_dim,
                        num_heads=a.expand * a.width // a.head_dim, n_groups=a.n_groups, chunk_size=a.chunk_size,
                        tie_word_embeddings=True, use_cache=False)


def replaced_hooks():
    """transformers' Mamba-2 kernel hooks whose implementation is not its own PyTorch code (each
    hook's wrapper closes over is_new_implementation; transformers/integrations/hub_kernels.py)."""
    from transformers.models.mamba2 import modeling_mamba2 as m

    def flags(f, seen):
        if id(f) in seen:
            return []
        seen.add(id(f))
        code, out = getattr(f, "__code__", None), []
        for name, cell in zip(code.co_freevars if code else (), getattr(f, "__closure__", None) or ()):
            v = cell.cell_contents
            out += [v] if name == "is_new_implementation" else flags(v, seen) if hasattr(v, "__code__") else []
        return out + (flags(f.__wrapped__, seen) if hasattr(f, "__wrapped__") else [])
    return [h for h in KERNEL_HOOKS if hasattr(m, h) and any(flags(getattr(m, h), set()))]


# --- the child processes ---------------------------------------------------------------------------

def child_init(a):
    """transformers' own initialisation of the model, saved in float32 (the folder ash imports)."""
    import torch
    import transformers
    torch.manual_seed(a.seed)
    save_model(a, transformers.Mamba2ForCausalLM(hf_config(a)).to(torch.float32))


def load_hf(a):
    import torch
    from transformers import Mamba2ForCausalLM
    torch.set_num_threads(a.threads)
    bad = replaced_hooks()
    if bad:  # this row claims transformers' PyTorch path
        sys.exit(f"transformers would run other kernels for {', '.join(bad)}, not its PyTorch path")
    model = Mamba2ForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    model.train()  # the training path: the mixer's fused hook first (refused above), then the torch path
    return torch, model


def child_hf(a):
    torch, model = load_hf(a)
    timed_gradient(torch, model, read_ids(torch, a))


def our_name(name):
    """Our /grad path (docs/file_format.md) of a transformers parameter name, and whether the
    tensor is the conv weight ([C, 1, Kc] there, [C, Kc] here)."""
    fixed = {"backbone.embeddings.weight": "embedding", "backbone.norm_f.weight": "final_norm",
             "lm_head.weight": "head"}
    if name in fixed:
        return fixed[name]
    k, rest = name[len("backbone.layers."):].split(".", 1)
    layer = {"norm.weight": "norm", "mixer.in_proj.weight": "in_proj", "mixer.conv1d.weight": "conv_weight",
             "mixer.conv1d.bias": "conv_bias", "mixer.dt_bias": "dt_bias", "mixer.A_log": "A_log", "mixer.D": "D",
             "mixer.norm.weight": "gated_norm", "mixer.out_proj.weight": "out_proj"}[rest]
    return f"layers/{int(k):03d}/{layer}"


def child_check(a):
    """transformers' loss and gradients at --check-T against ash's gradient file: check.json."""
    import h5py
    import numpy as np
    torch, model = load_hf(a)
    x = read_ids(torch, a)
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward()
    worst, bad, n = (0.0, ""), [], 0
    with h5py.File(a.ash_grad, "r") as f:
        ash_loss = float(f["/loss"][()])
        for name, p in model.named_parameters():  # the tied head appears once, as the embedding
            ours = our_name(name)
            ref = np.asarray(f["/grad/" + ours][...], dtype=np.float64)
            theirs = p.grad.detach().double().numpy().reshape(ref.shape)
            scale = float(np.max(np.abs(ref)))
            err = float(np.max(np.abs(theirs - ref))) / scale if scale > 0 else float(np.max(np.abs(theirs)))
            err = err if np.isfinite(err) else float("inf")
            worst, n = max(worst, (err, ours)), n + 1
            if not err <= a.grad_rtol:
                bad.append(f"{ours} {err:.2e}")
    loss_err = abs(loss.item() - ash_loss) / abs(ash_loss)
    ok = loss_err <= a.loss_rtol and not bad
    print(json.dumps({"check": True, "T": a.T, "loss_hf": loss.item(), "loss_ash": ash_loss, "loss_rel_error": loss_err,
                      "loss_rtol": a.loss_rtol, "tensors": n, "grad_worst_rel_error": worst[0],
                      "grad_worst_tensor": worst[1], "grad_rtol": a.grad_rtol, "grad_failed": bad, "passed": ok}))


# --- the parent -------------------------------------------------------------------------------------

def check(a, me, sizes, hf_dir, ck, tokens, work, env):
    """`ash grad` at --check-T, then the check child; returns its JSON (passed or not)."""
    grad = os.path.join(work, "check_grad.h5")
    r = subprocess.run([a.ash, "grad", "--checkpoint", ck, "--tokens", tokens, "--engine", "adjoint-exact", "--set",
                        f"data.seq_len={a.check_T}", "--set", "data.batch=1", "--out", grad],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"mamba2_cpu_vs_hf: ash grad for the check failed:\n{r.stderr}")
    st, o, e, _, _ = run_child(me + ["--child", "check", "--model-dir", hf_dir, "--tokens", tokens, "--T",
                                     str(a.check_T), "--ash-grad", grad, "--threads", str(a.threads),
                                     "--loss-rtol", str(a.loss_rtol), "--grad-rtol", str(a.grad_rtol)] + sizes,
                               env, 600, 0)
    if st != "ok":
        sys.exit(f"mamba2_cpu_vs_hf: the check's transformers run failed ({st}):\n{e}")
    return json.loads(o.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, ",".join(str(2**e) for e in range(12, 21)), 300, ("init", "hf", "check"))
    ap.add_argument("--budget", type=float, default=0, help="no run starts after this many seconds of sweep")
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--state", type=int, default=64)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-groups", type=int, default=1)
    ap.add_argument("--chunk-size", type=int, default=256, help="transformers' chunk_size")
    ap.add_argument("--check-T", type=int, default=600)
    ap.add_argument("--loss-rtol", type=float, default=1e-5, help="the check: relative loss difference")
    ap.add_argument("--grad-rtol", type=float, default=1e-3, help="the check: max |diff| / max |ours| per tensor")
    ap.add_argument("--no-check", action="store_true", help="skip the check (with --mutate: the sweep's must fail)")
    ap.add_argument("--ash-grad", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return {"init": child_init, "hf": child_hf, "check": child_check}[a.child](a)

    Ts = [int(t) for t in a.T_list.split(",")]
    impls = [i for i in a.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls or a.reps < 1 or a.threads < 1 or min(Ts) < 2 or a.check_T < 2:
        ap.error(f"--impls from {','.join(IMPLS)}; --reps, --threads >= 1; T >= 2 ({bad or ''})")
    if (a.expand * a.width) % a.head_dim or (a.expand * a.width // a.head_dim) % a.n_groups:
        ap.error("--head-dim must divide expand * width, and --n-groups the heads")
    if not os.access(a.ash, os.X_OK):
        ap.error(f"no ash executable at {a.ash} (--ash)")
    for mod in ("torch", "transformers", "h5py"):
        if importlib.util.find_spec(mod) is None:
            sys.exit(f"mamba2_cpu_vs_hf: {mod} is not installed")
    me = [sys.executable, os.path.abspath(__file__)]
    sizes = ["--width", str(a.width), "--state", str(a.state), "--head-dim", str(a.head_dim), "--n-groups",
             str(a.n_groups), "--layers", str(a.layers), "--vocab", str(a.vocab), "--expand", str(a.expand),
             "--conv-kernel", str(a.conv_kernel), "--chunk-size", str(a.chunk_size), "--seed", str(a.seed)]
    cap_kib, work, env, made, hf_dir, ck, tokens = prepare(a, me, sizes, max(Ts + [a.check_T]), True,
                                                           "mamba2_cpu_vs_hf")

    H = a.expand * a.width // a.head_dim
    head = (f"# model: transformers Mamba2ForCausalLM V={a.vocab} D={a.width} N={a.state} K={a.layers} "
            f"expand={a.expand} H={H} head_dim={a.head_dim} n_groups={a.n_groups} Kc={a.conv_kernel} "
            f"chunk_size={a.chunk_size} tied, {made['parameters']} parameters, float32, batch 1; seed {a.seed}\n"
            f"# torch {made['torch']}, transformers {made['transformers']} (its PyTorch path), {a.threads} "
            f"thread(s); per-run cap {a.timeout:.0f} s, {cap_kib / 2**20:.1f} GiB RSS"
            f"{f', sweep budget {a.budget:.0f} s' if a.budget else ''}; work {work}")
    print(head, flush=True)
    if not a.no_check:
        c = check(a, me, sizes, hf_dir, ck, tokens, work, env)
        print(json.dumps(c), flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(c) + "\n")
        verdict = (f"# check at T={a.check_T}: loss {c['loss_hf']:.9g} (ash {c['loss_ash']:.9g}), rel. error "
                   f"{c['loss_rel_error']:.1e} (bound {a.loss_rtol:g}); {c['tensors']} gradients, worst max |diff| / "
                   f"max |ours| {c['grad_worst_rel_error']:.1e} ({c['grad_worst_tensor']}; bound {a.grad_rtol:g})")
        head += "\n" + verdict
        print(verdict, flush=True)
        if not c["passed"]:
            over = ": " + ", ".join(c["grad_failed"][:6]) if c["grad_failed"] else ""
            print(f"mamba2_cpu_vs_hf: the check failed{over}", file=sys.stderr)
            return 1
    rows, mismatches = sweep(a, impls, Ts, cap_kib,
                             lambda impl, T: measure(a, impl, T, me, sizes, hf_dir, ck, tokens, work, env, cap_kib),
                             alternate=True, budget=a.budget)
    print()
    print(head)
    print(table(rows, impls, LABEL))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    for r in mismatches:
        print(f"mamba2_cpu_vs_hf: loss of {r['impl']} at T={r['T']} differs by {r['loss_rel_diff']:.2e} "
              f"(relative) from the first run's: not the same computation", file=sys.stderr)
    if mismatches:
        return 1
    if not any(r["status"] == "ok" for r in rows):
        print("mamba2_cpu_vs_hf: nothing was measured", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
