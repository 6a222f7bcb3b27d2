#!/usr/bin/env python3
"""ash's exact gradient (E3) against the same model with mamba-ssm's selective scan, side by side.

For every shape (P, K) of the sweep it writes an ash checkpoint (float), checks
mamba_baseline.py's loss and gradients against `ash grad` on it, then times one
gradient of both across T (batch 1) until out of memory or over the time budget, and
once at batch 8, by side_by_side.py's protocol: each point one untimed warm-up and --reps
(5) timed steps, min and median; theirs timed by CUDA events, under plain autograd and
with per-layer torch.utils.checkpoint (--modes: two rows per T); ours by ash_bench_grad's
in-process timer (process and CUDA start-up outside it); peaks with the parameters on both
sides; the losses compared at every T (a mismatch over --sweep-loss-rtol marks the rows
"loss_ok": false and exits 1). First, kernel-only rows: mamba-ssm's selective_scan_fn
forward + backward alone against ash_bench_kernels' fwd_scan + e3_layer (P = 64, N = 16;
ours includes the layer's dense VJPs: there is no scan-only backward of ours).

Rows (every field named: side, mode, T, reps, min_s, median_s, peak_bytes, loss, loss_ok,
warm, and the shape) go to OUT/rows.jsonl (the sides' own files: ash.jsonl, mamba.jsonl,
kernel.jsonl), the tables to OUT/summary.md and stdout, every command to OUT/log.txt.

    mamba_vs_ash.py --out DIR --python PY [--mamba-dir DIR] [--build build | --ash ASH --bench BENCH
                    --kernels KERNELS] [--widths 64,256,1024] [--layers 2,8] [--T 4096,...,16777216]
                    [--batch8-T 16384] [--kernel-T 1024,...,65536] [--modes autograd,checkpoint]
                    [--max-seconds 120] [--reps 5] [--deadline S] [--quick] [--mutate-sweep]

PY is the interpreter with torch (and mamba-ssm, or --mamba-dir from
perf_tests/mamba_build.sh). On a GPU machine ash must be a CUDA build (--build).
--ash / --bench / --kernels name the executables where they are not in a build folder
(the GPU bundle of perf_tests/gpu/bundle.sh). --deadline S: no measurement starts after S
seconds from the start; the summary is still written (a GPU window's stage has a fixed
budget). --quick is the host smoke run: mamba-ssm's selective_scan_ref on the CPU at tiny
sizes (it checks the plumbing, not speed). --mutate-sweep leaves D out of mamba-ssm's model
in the sweep only: the smoke test's proof that a loss mismatch is flagged.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from side_by_side import ash_row, definitions, make_row, mark_losses, read_rows, table, write_rows  # noqa: E402


def run(cmd, log, timeout=None):
    print("$ " + " ".join(cmd), flush=True)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        with open(log, "a") as f:
            f.write("$ " + " ".join(cmd) + "\n" + out + f"\n# stopped at the deadline ({timeout:.0f} s)\n")
        sys.stdout.write(out + f"# stopped at the deadline ({timeout:.0f} s)\n")
        return 124
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n" + r.stdout + r.stderr)
    sys.stdout.write(r.stdout)
    if r.returncode != 0:
        sys.stdout.write(r.stderr)
    return r.returncode


def bench_kernel_rows(kernels, Ts, reps, out, log, timeout, quick):
    """Our kernel rows: ash_bench_kernels' fwd_scan + e3_layer (fused) per repetition, summed; P = 64,
    N = 16 (its fixed sizes). There is no scan-only backward: e3_layer is one layer's whole E3
    backward, its dense VJPs included, so this row bounds our scans' time from above."""
    js = os.path.join(out, "ash_kernels.json")
    Tre = "|".join(str(t) for t in Ts)
    # reps + 1 repetitions, the first dropped: Google Benchmark 1.7 has no warm-up of its own
    rc = run([kernels, f"--benchmark_filter=^BM_(fwd_scan/({Tre})|e3_layer/({Tre})/1)/",
              f"--benchmark_repetitions={reps + 1}", "--benchmark_format=json", f"--benchmark_out={js}",
              f"--benchmark_min_time={0.01 if quick else 0.1}"], log, timeout)
    try:
        with open(js) as f:
            bench = [b for b in json.load(f)["benchmarks"] if b.get("run_type") == "iteration"]
    except (OSError, ValueError):
        bench = []
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    out_rows = []
    for T in Ts:
        per = {}
        for b in bench:
            name = b["name"].split("/")
            if int(name[1]) == T and b.get("repetition_index", 0) > 0:
                per.setdefault(name[0], []).append(b["real_time"] * scale[b.get("time_unit", "ns")])
        fwd, bwd = per.get("BM_fwd_scan", []), per.get("BM_e3_layer", [])
        note = ("fwd_scan + e3_layer/fused: one layer's scan forward and whole E3 backward (dense VJPs included; "
                "no scan-only backward exists)")
        if rc != 0 or not fwd or len(fwd) != len(bwd):
            note = f"ash_bench_kernels gave no rows for T={T} (exit {rc})"
            fwd = bwd = []
        out_rows.append(make_row("ash", "kernel", T, [a + b for a, b in zip(fwd, bwd)], None, None, batch=1,
                                 width=64, state=16, note=note,
                                 timer="ash_bench_kernels: real time per iteration (mean of one repetition; "
                                       "the first repetition untimed)"))
    return out_rows


def summary(out, rtol):
    """The joined rows (OUT/rows.jsonl) with loss_ok set, the tables (OUT/summary.md, stdout);
    returns the (P, K, batch, T) at which the losses disagree."""
    model = [r for r in read_rows(os.path.join(out, "ash.jsonl")) + read_rows(os.path.join(out, "mamba.jsonl"))
             if r.get("mode") != "kernel"]
    kernel = read_rows(os.path.join(out, "kernel.jsonl")) + [
        r for r in read_rows(os.path.join(out, "mamba.jsonl")) if r.get("mode") == "kernel"]
    key = lambda r: (r.get("width"), r.get("layers"), r.get("batch"), r["T"])  # noqa: E731
    bad = mark_losses(model, key, rtol)
    write_rows(os.path.join(out, "rows.jsonl"), model + kernel)
    group = ("width", "layers", "batch")
    longest = ["| P | K | side | mode | longest T |", "|---|---|---|---|---|"]
    for P, K, side, mode in sorted({(r.get("width"), r.get("layers"), r["side"], r["mode"]) for r in model}):
        Ts = [r["T"] for r in model if (r.get("width"), r.get("layers"), r["side"], r["mode"], r.get("batch")) ==
              (P, K, side, mode, 1) and r.get("median_s") is not None]
        longest.append(f"| {P} | {K} | {side} | {mode} | {max(Ts, default='-')} |")
    text = ("E3 (ash) against the same model with mamba-ssm's selective_scan_fn, float "
            "(P: width, K: layers; N = 16, V = 256)\n\n" + table(model, group) + "\n" + "\n".join(longest) + "\n")
    if kernel:
        text += ("\nKernel-only rows (P = 64, N = 16, batch 1): theirs selective_scan_fn forward + backward on "
                 "random inputs, timed as their steps (the peak includes a P = 64, K = 1 model's parameters); ours "
                 "ash_bench_kernels' real time per iteration (the mean over one repetition; --reps + 1 repetitions, "
                 "the first dropped as the warm-up).\n\n" + table(kernel, ("width",)))
    text += "\n" + definitions(rtol) + (f"\nLOSS MISMATCH at (P, K, batch, T) = {bad}\n" if bad else
                                         f"\nLosses agree at every T both sides measured (tolerance {rtol:g}).\n")
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable, help="interpreter with torch (and mamba-ssm)")
    ap.add_argument("--mamba-dir", help="perf_tests/mamba_build.sh's output folder")
    ap.add_argument("--build", default="build", help="the ash build folder (a CUDA build on a GPU)")
    ap.add_argument("--ash", help="the ash executable (default: BUILD/src/ash)")
    ap.add_argument("--bench", help="ash_bench_grad (default: BUILD/perf_tests/ash_bench_grad)")
    ap.add_argument("--kernels", help="ash_bench_kernels (default: BUILD/perf_tests/ash_bench_kernels)")
    ap.add_argument("--deadline", type=float, default=0, help="start no measurement after this many seconds")
    ap.add_argument("--widths", default="64,256,1024")
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--T", default=",".join(str(2**e) for e in range(12, 25)))
    ap.add_argument("--batch8-T", type=int, default=16384, help="T of the batch-8 comparison (0: none)")
    ap.add_argument("--check-T", type=int, default=1024)
    ap.add_argument("--kernel-T", default="1024,4096,16384,65536",
                    help="T of the kernel-only rows (ash_bench_kernels' sizes: 1024·4^i up to 65536; empty: none)")
    ap.add_argument("--modes", default="autograd,checkpoint", help="mamba-ssm's modes (mamba_baseline.py --modes)")
    ap.add_argument("--max-seconds", type=float, default=120, help="per measurement (reps + warm-up)")
    ap.add_argument("--reps", type=int, default=5, help="timed reps per point on each side, after one warm-up")
    ap.add_argument("--sweep-loss-rtol", type=float, default=1e-4, help="the two losses at every T both measured")
    ap.add_argument("--mutate-sweep", action="store_true",
                    help="mamba-ssm's sweep without its D term (the check stays right): every T's losses must then "
                         "be flagged")
    ap.add_argument("--ash-args", default="", help="more ash_bench_grad options for our E3 rows (e.g. '--e3-form walk "
                    "--chunk 128'); the rows carry them as ash_args")
    ap.add_argument("--quick", action="store_true", help="host smoke run: selective_scan_ref on the CPU, tiny sizes")
    args = ap.parse_args()
    if args.quick:
        args.widths, args.layers, args.T, args.batch8_T, args.check_T = "16", "2", "64,128", 64, 64
        args.kernel_T, args.reps = ("1024" if args.kernel_T else ""), 2
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    os.makedirs(args.out, exist_ok=True)
    for name in ("ash.jsonl", "mamba.jsonl", "kernel.jsonl", "rows.jsonl", "log.txt", "summary.md"):
        if os.path.exists(os.path.join(args.out, name)):  # this run's rows only
            os.remove(os.path.join(args.out, name))
    log = os.path.join(args.out, "log.txt")
    ash = args.ash or os.path.join(args.build, "src", "ash")
    bench = args.bench or os.path.join(args.build, "perf_tests", "ash_bench_grad")
    kernels = args.kernels or os.path.join(args.build, "perf_tests", "ash_bench_kernels")
    t_start = time.monotonic()

    def out_of_time(what):
        if args.deadline and time.monotonic() - t_start > args.deadline:
            print(f"# deadline ({args.deadline:.0f} s) reached: {what} and the rest not measured", flush=True)
            return True
        return False

    def left():
        return max(1.0, args.deadline - (time.monotonic() - t_start)) if args.deadline else None

    scan = ["--scan", "ref", "--device", "cpu", "--threads", "1"] if args.quick else []
    mamba_dir = ["--mamba-dir", args.mamba_dir] if args.mamba_dir else []
    Ts = [int(t) for t in args.T.split(",")]
    kernel_Ts = [int(t) for t in args.kernel_T.split(",") if t]
    # Kernel-only rows first: a few seconds a side, so a deadline never cuts them.
    if kernel_Ts and not out_of_time("the kernel-only rows"):
        run([args.python, os.path.join(HERE, "mamba_baseline.py"), "--width", "64", "--state", "16", "--layers", "1",
             "--no-sweep", "--T", str(kernel_Ts[0]), "--kernel-T", ",".join(map(str, kernel_Ts)), "--reps",
             str(args.reps), "--json", os.path.join(args.out, "kernel.jsonl")] + scan + mamba_dir, log, left())
        if os.path.exists(kernels):
            ours = bench_kernel_rows(kernels, kernel_Ts, args.reps, args.out, log, left(), args.quick)
        else:
            print(f"# {kernels} not found: no kernel-only row of ours", flush=True)
            ours = [make_row("ash", "kernel", T, [], None, None, width=64, state=16, note=f"{kernels} not found")
                    for T in kernel_Ts]
        write_rows(os.path.join(args.out, "kernel.jsonl"), read_rows(os.path.join(args.out, "kernel.jsonl")) + ours)
    failed = 0
    shapes = [(int(p), int(k)) for p in args.widths.split(",") for k in args.layers.split(",")]
    for P, K in shapes:
        if out_of_time(f"P={P} K={K}"):
            break
        ckpt = os.path.join(args.out, f"model_P{P}_K{K}.h5")
        sizes = ["--set", f"model.width={P}", "--set", "model.state=16", "--set", f"model.layers={K}",
                 "--set", "model.vocab=256"]
        if run([ash, "init", "--precision", "float", "--out", ckpt] + sizes, log, left()):
            return 1
        base = [args.python, os.path.join(HERE, "mamba_baseline.py"), "--checkpoint", ckpt, "--reps",
                str(args.reps), "--max-seconds", str(args.max_seconds), "--json",
                os.path.join(args.out, "mamba.jsonl")] + scan + mamba_dir
        # the mapping, checked on this shape: loss and every gradient against ash grad
        failed += run(base + ["--check-ash", ash, "--check-T", str(args.check_T), "--T", str(args.check_T),
                              "--no-sweep"], log, left()) != 0
        runs = [(1, Ts)] + ([(8, [args.batch8_T])] if args.batch8_T else [])
        for batch, T_list in runs:
            if out_of_time(f"P={P} K={K} batch={batch}"):
                break
            run(base + ["--batch", str(batch), "--T", ",".join(map(str, T_list)), "--modes", args.modes] +
                (["--mutate"] if args.mutate_sweep else []), log, left())
            last = None  # ash: one process per T, stopped by a failure or the time budget
            for T in T_list:
                if out_of_time(f"ash E3 P={P} K={K} batch={batch} T={T}"):
                    break
                if last and last["median_s"] * T / last["T"] * (args.reps + 2) > args.max_seconds:
                    print(f"# ash E3 P={P} K={K} batch={batch}: T={T} and up skipped (time budget)")
                    break
                one = os.path.join(args.out, "ash_last.jsonl")  # the benchmark rewrites its --json file
                if os.path.exists(one):
                    os.remove(one)
                run([bench, "--engines", "adjoint-exact", "--T", str(T), "--width", str(P), "--state", "16",
                     "--layers", str(K), "--vocab", "256", "--batch", str(batch), "--reps", str(args.reps),
                     "--warmup", "1", "--precision", "float", "--json", one] + shlex.split(args.ash_args), log, left())
                new = read_rows(one)
                if not new:  # out of memory or another failure: the rest of the series is larger
                    break
                last = ash_row(new[-1], "E3")
                last["ash_args"] = args.ash_args
                with open(os.path.join(args.out, "ash.jsonl"), "a") as f:
                    f.write(json.dumps(last) + "\n")
    bad = summary(args.out, args.sweep_loss_rtol)
    measured = [len(read_rows(os.path.join(args.out, f))) for f in ("ash.jsonl", "mamba.jsonl")]
    if min(measured) == 0:
        print(f"mamba_vs_ash: no measurement of {'ash' if measured[0] == 0 else 'mamba-ssm'}", file=sys.stderr)
        return 1
    if failed:
        print(f"mamba_vs_ash: {failed} shape(s) failed the check against ash grad", file=sys.stderr)
    if bad:
        print(f"mamba_vs_ash: the losses disagree at (P, K, batch, T) = {bad}", file=sys.stderr)
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
