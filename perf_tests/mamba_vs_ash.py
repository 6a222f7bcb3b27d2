#!/usr/bin/env python3
"""ash's exact gradient (E3) against the same model with mamba-ssm's selective scan, side by side.

For every shape (P, K) of the sweep it writes an ash checkpoint (float), checks
mamba_baseline.py's loss and gradients against `ash grad` on it, then times one
gradient of both across T (batch 1), each after one untimed warm-up (mamba_baseline.py:
best of --reps; ash_bench_grad: their median), until out of memory or over the time budget,
and once at batch 8; the rows go to OUT/ash.jsonl and OUT/mamba.jsonl, a joined
table (time and peak ratios, longest T of each) to OUT/summary.md and stdout.

    mamba_vs_ash.py --out DIR --python PY [--mamba-dir DIR] [--build build | --ash ASH --bench BENCH]
                    [--widths 64,256,1024] [--layers 2,8] [--T 4096,...,16777216]
                    [--batch8-T 16384] [--max-seconds 120] [--reps 3] [--deadline S] [--quick]

PY is the interpreter with torch (and mamba-ssm, or --mamba-dir from
perf_tests/mamba_build.sh). On a GPU machine ash must be a CUDA build (--build).
--ash / --bench name the two executables where they are not in a build folder (the GPU
bundle of perf_tests/gpu/bundle.sh). --deadline S: no measurement starts after S seconds
from the start; the summary is still written (a GPU window's stage has a fixed budget).
--quick is the host smoke run: mamba-ssm's selective_scan_ref on the CPU at tiny
sizes (it checks the plumbing, not speed).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


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


def rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mib(b):
    return f"{b / 2**20:.1f} MiB" if b else "-"


def summary(out):
    ash = [r for r in rows(os.path.join(out, "ash.jsonl")) if r.get("engine", "").startswith("adjoint-exact")]
    mam = [r for r in rows(os.path.join(out, "mamba.jsonl")) if not r.get("oom")]
    key = lambda r: (r["width"], r["layers"], r["batch"], r["T"])  # noqa: E731
    a = {key(r): r for r in ash}
    m = {key(r): r for r in mam}
    lines = ["| P | K | batch | T | E3 s | mamba-ssm s | E3 / mamba time | E3 peak | mamba peak | E3 / mamba peak |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k in sorted(set(a) | set(m)):
        ra, rm = a.get(k), m.get(k)
        ta, tm = (ra or {}).get("seconds"), (rm or {}).get("seconds")
        pa, pm = (ra or {}).get("peak_bytes"), (rm or {}).get("peak_bytes")
        lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | {ta if ta is None else f'{ta:.4f}'} | "
                     f"{tm if tm is None else f'{tm:.4f}'} | {f'{ta / tm:.2f}' if ta and tm else '-'} | "
                     f"{mib(pa)} | {mib(pm)} | {f'{pa / pm:.2f}' if pa and pm else '-'} |")
    longest = ["", "| P | K | longest T, E3 | longest T, mamba-ssm |", "|---|---|---|---|"]
    for P, K in sorted({(k[0], k[1]) for k in set(a) | set(m)}):
        la = max([k[3] for k in a if k[:3] == (P, K, 1)], default=0)
        lm = max([k[3] for k in m if k[:3] == (P, K, 1)], default=0)
        longest.append(f"| {P} | {K} | {la} | {lm} |")
    text = "\n".join(lines + longest) + "\n"
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable, help="interpreter with torch (and mamba-ssm)")
    ap.add_argument("--mamba-dir", help="perf_tests/mamba_build.sh's output folder")
    ap.add_argument("--build", default="build", help="the ash build folder (a CUDA build on a GPU)")
    ap.add_argument("--ash", help="the ash executable (default: BUILD/src/ash)")
    ap.add_argument("--bench", help="ash_bench_grad (default: BUILD/perf_tests/ash_bench_grad)")
    ap.add_argument("--deadline", type=float, default=0, help="start no measurement after this many seconds")
    ap.add_argument("--widths", default="64,256,1024")
    ap.add_argument("--layers", default="2,8")
    ap.add_argument("--T", default=",".join(str(2**e) for e in range(12, 25)))
    ap.add_argument("--batch8-T", type=int, default=16384, help="T of the batch-8 comparison (0: none)")
    ap.add_argument("--check-T", type=int, default=1024)
    ap.add_argument("--max-seconds", type=float, default=120, help="per measurement (reps + warm-up)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="host smoke run: selective_scan_ref on the CPU, tiny sizes")
    args = ap.parse_args()
    if args.quick:
        args.widths, args.layers, args.T, args.batch8_T, args.check_T, args.reps = "16", "2", "64,128", 64, 64, 1
    os.makedirs(args.out, exist_ok=True)
    for name in ("ash.jsonl", "mamba.jsonl", "log.txt"):  # this run's rows only
        if os.path.exists(os.path.join(args.out, name)):
            os.remove(os.path.join(args.out, name))
    log = os.path.join(args.out, "log.txt")
    ash = args.ash or os.path.join(args.build, "src", "ash")
    bench = args.bench or os.path.join(args.build, "perf_tests", "ash_bench_grad")
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
            run(base + ["--batch", str(batch), "--T", ",".join(map(str, T_list))], log, left())
            last = None  # ash: one process per T, stopped by a failure or the time budget
            for T in T_list:
                if out_of_time(f"ash E3 P={P} K={K} batch={batch} T={T}"):
                    break
                if last and last["seconds"] * T / last["T"] * (args.reps + 2) > args.max_seconds:
                    print(f"# ash E3 P={P} K={K} batch={batch}: T={T} and up skipped (time budget)")
                    break
                one = os.path.join(args.out, "ash_last.jsonl")  # the benchmark rewrites its --json file
                if os.path.exists(one):
                    os.remove(one)
                run([bench, "--engines", "adjoint-exact", "--T", str(T), "--width", str(P), "--state", "16",
                     "--layers", str(K), "--batch", str(batch), "--reps", str(args.reps), "--warmup", "1",
                     "--precision", "float", "--json", one], log, left())
                new = rows(one)
                if not new:  # out of memory or another failure: the rest of the series is larger
                    break
                with open(os.path.join(args.out, "ash.jsonl"), "a") as f:
                    f.write(json.dumps(new[-1]) + "\n")
                last = new[-1]
    summary(args.out)
    measured = [len(rows(os.path.join(args.out, f))) for f in ("ash.jsonl", "mamba.jsonl")]
    if min(measured) == 0:
        print(f"mamba_vs_ash: no measurement of {'ash' if measured[0] == 0 else 'mamba-ssm'}", file=sys.stderr)
        return 1
    if failed:
        print(f"mamba_vs_ash: {failed} shape(s) failed the check against ash grad", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
