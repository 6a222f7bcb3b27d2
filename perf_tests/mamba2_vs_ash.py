#!/usr/bin/env python3
"""Our Mamba-2 (model.arch=mamba2, E3 exact) against mamba-ssm's `Mamba2` blocks, side by side.

The model is a stack of Mamba-2 blocks as transformers' Mamba2ForCausalLM lays it out
(docs/design.md §1): embedding, K pre-norm residual blocks h ← h + mixer(RMSNorm(h)), a final
RMSNorm and the tied head, the loss the mean cross-entropy of next-token targets. Theirs:
each mixer is mamba-ssm 2.3.2.post1's `mamba_ssm.modules.mamba2.Mamba2` (the same tensors as
transformers' Mamba2Mixer: in_proj [z, x, B, C, Δ], the depthwise conv with bias, dt_bias,
A_log, D per head, the gated RMSNorm with norm_before_gate=False in n_groups groups, out_proj;
its RMSNorm's epsilon is fixed at 1e-5, so ours is model.norm_eps = 1e-5), RMSNorm and head
eager PyTorch. Ours: `ash grad` (the check) and `ash_bench_grad --arch mamba2` (the sweep),
E3 exact. Both use the parameters of one `ash init` checkpoint (copied tensor by tensor) and
the same tokens (torch_baseline's synthetic ids, as ash_bench_grad makes them).

    mamba2_vs_ash.py --out DIR [--build build | --ash ASH --bench BENCH] [--mamba-dir DIR]
                     [--width 256 --state 64 --head-dim 64 --n-groups 1 --layers 4 --vocab 256
                      --expand 2 --conv-kernel 4 --chunk-size 256]
                     [--T 4096,8192,...] [--batch 1] [--check-T 2000 --check-batch 2]
                     [--reps 5] [--modes autograd,checkpoint,fast] [--max-seconds 30]
                     [--deadline S] [--quick] [--mutate | --mutate-sweep]

1. The check: loss and every parameter's gradient of theirs against `ash grad --engine
   adjoint-exact` at --check-T (exit 1 unless within --loss-rtol / --grad-rtol; max
   |difference| over the tensor's max |value|). --mutate reverses their conv taps.
2. Their sweep by side_by_side.py's protocol (one untimed warm-up, --reps timed steps by
   CUDA events, min and median, torch.cuda.max_memory_allocated per point), per T one row
   per mode: "autograd" (use_mem_eff_path=False: the conv, mamba_chunk_scan_combined's Triton
   SSD forward and backward, the gated norm's Triton kernel, under autograd), "checkpoint"
   (the same with each block under torch.utils.checkpoint: the memory class of a gradient that
   keeps layer inputs only) and "fast" (use_mem_eff_path=True: mamba_split_conv1d_scan_combined,
   which needs causal-conv1d's CUDA kernels; where they are missing a row per T says so).
   A mode ends at out of memory, past --max-seconds, or at its share of the deadline.
3. Our sweep: one ash_bench_grad process per T (one warm-up, --reps timed gradients, min and
   median, "peak_total_bytes"), as mamba_block_vs_ash.py's.
At every T both measured the losses must agree within --sweep-loss-rtol (--mutate-sweep
reverses their conv taps in the sweep only, to show that it is checked).

Rows: OUT/rows.jsonl (every field of side_by_side.ROW_FIELDS), OUT/check.json, the table in
OUT/summary.md and on stdout, every command in OUT/log.txt.
--quick is the host dry run: tiny sizes on the CPU, where mamba-ssm's Triton kernels cannot
run: its Mamba2 module with its own pure-PyTorch references swapped in (ssd_chunk_scan_combined_ref
for mamba_chunk_scan_combined, rms_norm_ref for the gated norm's kernel): the plumbing, the
weight mapping and the check, not speed. Where mamba_ssm is not importable at all, their side
is skipped and the run says so (ours still runs). Exit 1 on a failed check, a loss mismatch or
no measurement of a side that ran.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from mamba_block_vs_ash import (_device_name, compare_with_ash, drive, driver_args, load_into,  # noqa: E402
                                read_checkpoint, stack_model, stack_names, their_sweep, their_tokens)

LAYER = ("norm", "in_proj", "conv_weight", "conv_bias", "dt_bias", "A_log", "D", "gated_norm", "out_proj")


# --- theirs: mamba-ssm's Mamba2 blocks, stacked as Mamba2ForCausalLM ------------------------------

def mamba_ssm_missing(mamba_dir):
    """Why mamba-ssm's Mamba2 cannot be imported here (None where it can): its module imports
    einops, triton and huggingface_hub; mamba_ssm itself comes from --mamba-dir or the interpreter."""
    import importlib.util
    for mod in ("torch", "einops", "triton", "huggingface_hub") + (() if mamba_dir else ("mamba_ssm",)):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not importable"
    return None


def import_mamba2(mamba_dir, need_cuda):
    """mamba-ssm's Mamba2 class, its version and the conv it runs (without the package's __init__, as
    mamba_baseline imports it). Off CUDA, its pure-PyTorch references replace its Triton kernels."""
    from mamba_baseline import import_mamba_scan
    _, _, version, _ = import_mamba_scan(mamba_dir, need_cuda)
    from mamba_ssm.modules import mamba2
    if not need_cuda:
        from mamba_ssm.ops.triton.layernorm_gated import rms_norm_ref
        from mamba_ssm.ops.triton.ssd_combined import ssd_chunk_scan_combined_ref

        def chunk_scan_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, dt_softplus=False, seq_idx=None,
                           cu_seqlens=None, return_final_states=False, return_varlen_states=False, **limit):
            assert not (seq_idx is not None or cu_seqlens is not None or return_final_states or limit), "not built"
            return ssd_chunk_scan_combined_ref(x, dt, A, B, C, chunk_size, D=D, z=z, dt_bias=dt_bias,
                                               dt_softplus=dt_softplus)

        def norm_ref(self, x, z=None):
            return rms_norm_ref(x, self.weight, self.bias, z=z, eps=self.eps, group_size=self.group_size,
                                norm_before_gate=self.norm_before_gate)
        mamba2.mamba_chunk_scan_combined = chunk_scan_ref
        mamba2.RMSNormGated.forward = norm_ref
    conv = "causal_conv1d" if mamba2.causal_conv1d_fn is not None else "F.conv1d"
    return mamba2.Mamba2, version, conv


def fast_path_missing(need_cuda):
    """Why Mamba2(use_mem_eff_path=True) cannot run here; None where it can."""
    if not need_cuda:
        return "needs CUDA (mamba_split_conv1d_scan_combined is Triton and causal-conv1d)"
    from mamba_ssm.ops.triton import ssd_combined
    if getattr(ssd_combined, "causal_conv1d_fwd_function", None) is None:
        return "causal_conv1d is not importable"
    return None


def build_model(torch, Mamba2, checkpoint, device, chunk_size, mutate=False):
    """(model, dims, names): the stack with the checkpoint's tensors; names maps our /params path to
    (parameter, shape of ours) so gradients compare by our names."""
    m, params = read_checkpoint(checkpoint, "mamba2", "mamba2_vs_ash")
    D, K, Kc, P, G = m["width"], m["layers"], m["conv_kernel"], m["head_dim"], m["n_groups"]
    E = m["expand"] * D
    if m.get("heads") not in (0, E // P) or m.get("time_step_limit_min") or m.get("time_step_limit_max") or \
            float(m["norm_eps"]) != 1e-5:
        raise SystemExit("mamba2_vs_ash: the checkpoint needs heads = E / head_dim, no time_step_limit and "
                         "norm_eps = 1e-5 (mamba-ssm's Mamba2 fixes its gated norm's epsilon)")
    model = stack_model(torch, m, device, lambda k: Mamba2(
        d_model=D, d_state=m["state"], d_conv=Kc, expand=m["expand"], headdim=P, ngroups=G, chunk_size=chunk_size,
        use_mem_eff_path=False, layer_idx=k, device=device, dtype=torch.float32))
    names = stack_names(model, m)
    for k in range(K):
        mx, a = model.mixers[k], f"layers/{k:03d}/"
        theirs = (model.norms[k], mx.in_proj.weight, mx.conv1d.weight, mx.conv1d.bias, mx.dt_bias, mx.A_log, mx.D,
                  mx.norm.weight, mx.out_proj.weight)
        names.update({a + ours: (p, (mx.conv1d.weight.shape[0], Kc) if ours == "conv_weight" else None)
                      for ours, p in zip(LAYER, theirs)})
    load_into(torch, model, names, params, device, mutate, "mamba2_vs_ash")
    dims = {"vocab": m["vocab"], "width": D, "state": m["state"], "layers": K, "expand": m["expand"],
            "conv_kernel": Kc, "head_dim": P, "n_groups": G, "heads": E // P, "chunk_size": chunk_size,
            "tie_embeddings": bool(m["tie_embeddings"])}
    return model, dims, names


def setup(args):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    Mamba2, version, conv = import_mamba2(args.mamba_dir, device.type == "cuda")
    return torch, device, Mamba2, version, conv


def role_check(args):
    """The check (in a process of its own): theirs' loss and gradients against OUR gradient file."""
    torch, device, Mamba2, version, conv = setup(args)
    model, dims, names = build_model(torch, Mamba2, args.checkpoint, device, args.chunk_size, args.mutate)
    x = their_tokens(torch, args.check_T, args.check_batch, dims["vocab"], device)
    loss = model(x)
    loss.backward()
    return compare_with_ash(args, loss, names, {
        "mamba_ssm": version, "conv": conv, "device": _device_name(torch, device), "torch": torch.__version__,
        "kernels": "Triton" if device.type == "cuda" else "pure-PyTorch references (host dry run)", **dims})


def role_sweep(args):
    """Their sweep (in a process of its own, so its allocator's memory is gone before ours runs)."""
    import torch.utils.checkpoint  # noqa: F401  (mode "checkpoint")
    from side_by_side import PEAK_TORCH, PROGRESS_HEAD, TIMER_TORCH_CPU, TIMER_TORCH_CUDA
    torch, device, Mamba2, version, conv = setup(args)
    cuda = device.type == "cuda"
    modes = args.modes.split(",")
    model, dims, _ = build_model(torch, Mamba2, args.checkpoint, device, args.chunk_size, args.mutate_sweep)
    missing = fast_path_missing(cuda) if "fast" in modes else None
    base = {"engine": "mamba-ssm Mamba2",
            "ssd": "mamba_chunk_scan_combined" if cuda else "ssd_chunk_scan_combined_ref", "conv": conv,
            "mamba_ssm": version, "torch": torch.__version__, "device": _device_name(torch, device),
            "timer": TIMER_TORCH_CUDA if cuda else TIMER_TORCH_CPU, "peak": PEAK_TORCH if cuda else None,
            "batch": args.batch, **dims}
    print(f"# mamba-ssm {version} Mamba2 blocks (modes {args.modes}: autograd and checkpoint use_mem_eff_path=False, "
          f"SSD {base['ssd']}, conv {conv}; fast: {missing or 'mamba_split_conv1d_scan_combined'}); "
          f"torch {torch.__version__}, {base['device']}, float32; {dims}", flush=True)
    print(PROGRESS_HEAD, flush=True)
    return their_sweep(args, torch, device, model, dims["vocab"], base, modes, missing, "use_mem_eff_path",
                       lambda fast: {"use_mem_eff_path": fast})


# --- the driver: no CUDA in this process ------------------------------------------------------------

def head_of_check(c):
    return (f"Mamba-2 D={c['width']} N={c['state']} K={c['layers']} V={c['vocab']} H={c['heads']} "
            f"head_dim={c['head_dim']} n_groups={c['n_groups']} chunk={c['chunk_size']}, float; theirs: mamba-ssm "
            f"{c['mamba_ssm']} Mamba2 ({c['kernels']}; autograd and checkpoint: use_mem_eff_path=False, conv "
            f"{c['conv']}; fast: use_mem_eff_path=True), {c['device']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    driver_args(ap, ",".join(str(2**e) for e in range(12, 23)),
                "mamba-ssm's: autograd (use_mem_eff_path=False), checkpoint (the same, each block under "
                "torch.utils.checkpoint), fast (use_mem_eff_path=True)",
                "a folder with mamba_ssm/ (and selective_scan_cuda*.so: perf_tests/gpu/mamba_link.py)")
    ap.add_argument("--width", type=int, default=256, help="D")
    ap.add_argument("--state", type=int, default=64, help="N")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--n-groups", type=int, default=1)
    ap.add_argument("--layers", type=int, default=4, help="K")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=256, help="mamba-ssm's chunk_size")
    args = ap.parse_args()
    if args.quick:  # T multiples of the chunk: the reference scan pads Δ only
        args.width, args.state, args.head_dim, args.n_groups, args.layers, args.vocab, args.conv_kernel = \
            16, 4, 8, 2, 2, 64, 3
        args.chunk_size, args.T, args.check_T, args.check_batch, args.reps = 16, "64,128", 48, 2, 2
        args.device, args.threads = "cpu", 1
    if args.role == "check":
        return role_check(args)
    if args.role == "sweep":
        return role_sweep(args)
    sizes = {"width": args.width, "state": args.state, "layers": args.layers, "vocab": args.vocab,
             "expand": args.expand, "conv_kernel": args.conv_kernel, "head_dim": args.head_dim,
             "n_groups": args.n_groups}  # model.norm_eps: the default 1e-5 (build_model checks it)
    return drive(args, __file__, "mamba2", sizes, ["--chunk-size", str(args.chunk_size)], head_of_check,
                 mamba_ssm_missing(args.mamba_dir))


if __name__ == "__main__":
    sys.exit(main())
