#!/usr/bin/env python3
"""Training past memory, measured (issue 11): what each memory lever costs and saves.

  python3 perf_tests/memory_study.py [--out DIR] [--quick] [--skip-train]

1. Bytes per token and the longest context that fits this machine, per engine
   and lever, on the bench model (V=256 P=256 N=16 K=8) and a K=32 model, from
   the memory planner (`ash plan`; checked against the measured Kokkos peak in
   unit_tests/test_memory_plan.cpp), batch 1, float.
2. The planned footprint of a 1.3B-parameter model (P=4096, N=16, K=80) at
   T = 100K on one 80 GB GPU.
3. Measured: `ash grad` on the bench model with each lever, peak memory against
   the plan, time, and the gradient error of 16-bit storage against float
   storage (cosine and relative L2 per parameter group).
4. The README's main job (examples/configs/fortunes.json) trained with
   run.storage = float, bf16, fp16: the validation curve of each.
Writes DIR/memory_study.json and prints markdown tables.
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LEVERS = {
    "E1 (backprop)": ["grad.engine=backprop"],
    "E3": ["grad.engine=adjoint-exact"],
    "E3 + bf16": ["grad.engine=adjoint-exact", "run.storage=bf16"],
    "E3 + bf16 + checkpointing": ["grad.engine=adjoint-exact", "run.storage=bf16", "grad.layer_checkpoint=auto"],
}


def sets(lst):
    out = []
    for s in lst:
        out += ["--set", s]
    return out


def model_sets(V, P, N, K):
    return [f"model.vocab={V}", f"model.width={P}", f"model.state={N}", f"model.layers={K}"]


def plan(ash, cfg, max_memory=None):
    cmd = [ash, "plan", "--for", "grad"] + sets(cfg)
    if max_memory:
        cmd += ["--max-memory", str(int(max_memory))]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        sys.exit(f"ash plan failed: {r.stderr}")
    total = None
    for line in r.stdout.splitlines():
        if line.strip().startswith("total (predicted peak)"):
            total = line.split()[-2:]
    return r.returncode == 0, to_bytes(total), r.stdout


def to_bytes(parts):
    v, unit = float(parts[0]), parts[1]
    return v * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]


def longest_T(ash, base, max_memory=None):
    """Largest T (a multiple of 1024) the plan fits in memory, by bisection."""
    lo, hi = 1024, 1024
    while plan(ash, base + [f"data.seq_len={hi}"], max_memory)[0]:
        lo, hi = hi, hi * 2
        if hi > 2**34:
            return lo
    if not plan(ash, base + [f"data.seq_len={lo}"], max_memory)[0]:
        return 0
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        if plan(ash, base + [f"data.seq_len={mid}"], max_memory)[0]:
            lo = mid
        else:
            hi = mid
    return lo


def fmt_bytes(b):
    for unit, f in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return f"{b / f:.2f} {unit}"
    return f"{b:.0f} B"


def run(cmd, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def compare(a, b):
    """Per parameter group: cosine and relative L2 of gradient file a against b."""
    import h5py
    import numpy as np
    out = {}
    with h5py.File(a) as fa, h5py.File(b) as fb:
        groups = {}

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                g = name.split("/")
                key = g[0] if g[0] != "layers" else "layers/" + g[-1]
                groups.setdefault(key, []).append(name)
        fa["grad"].visititems(visit)
        for key, names in sorted(groups.items()):
            x = np.concatenate([fa["grad"][n][...].ravel() for n in names]).astype(np.float64)
            y = np.concatenate([fb["grad"][n][...].ravel() for n in names]).astype(np.float64)
            cos = float(x @ y / math.sqrt((x @ x) * (y @ y)))
            rel = float(np.linalg.norm(x - y) / np.linalg.norm(y))
            out[key] = {"cosine": cos, "rel": rel}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ash", default=os.path.join(os.environ.get("ASH_BUILD_DIR", os.path.join(ROOT, "build")), "src", "ash"))
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "memory_study"))
    ap.add_argument("--T", type=int, default=65536, help="window of the measured gradients (step 3)")
    ap.add_argument("--quick", action="store_true", help="small sizes, for the smoke test")
    ap.add_argument("--skip-train", action="store_true", help="no step 4")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    res = {"levers": {}, "big": {}, "measured": {}, "train": {}}
    models = {"bench K=8": (256, 256, 16, 8), "K=32": (256, 256, 16, 32)}
    if a.quick:
        models = {"tiny K=4": (256, 16, 4, 4)}
        a.T = 2048

    # 1. bytes per token and the longest T on this machine
    print("\n## Bytes per token and longest context (planner, batch 1, float)\n")
    print("| model | engine / lever | bytes per token at T = 2^20 | longest T in this machine's memory |")
    print("|---|---|---|---|")
    for mname, (V, P, N, K) in models.items():
        for lname, lv in LEVERS.items():
            base = model_sets(V, P, N, K) + ["data.batch=1"] + lv
            T0 = 2**20 if not a.quick else 2**14
            _, total, _ = plan(a.ash, base + [f"data.seq_len={T0}"], 2**60)
            longest = longest_T(a.ash, base) if not a.quick else 0
            res["levers"][f"{mname} | {lname}"] = {"bytes_per_token": total / T0, "longest_T": longest}
            print(f"| {mname} | {lname} | {total / T0:,.0f} | {longest:,} |")

    # 2. the 1.3B model at T = 100K on an 80 GB GPU
    if not a.quick:
        print("\n## 1.3B parameters (V=256 P=4096 N=16 K=80), T = 100K, batch 1, float, one 80 GB GPU (planner)\n")
        print("| engine / lever | planned peak | fits 80 GB |")
        print("|---|---|---|")
        for lname, lv in LEVERS.items():
            cfg = model_sets(256, 4096, 16, 80) + ["data.batch=1", "data.seq_len=102400"] + lv
            fits, total, table = plan(a.ash, cfg, 80e9)
            res["big"][lname] = {"bytes": total, "fits_80GB": fits, "table": table}
            print(f"| {lname} | {fmt_bytes(total)} | {'yes' if fits else 'no'} |")

    # 3. measured gradients: peak vs plan, time, error of 16-bit storage
    V, P, N, K = list(models.values())[0]
    model = os.path.join(a.out, "model.h5")
    corpus = os.path.join(ROOT, "build", "data", "fortunes.txt")
    if not os.path.exists(corpus):
        corpus = "/usr/share/common-licenses/GPL-3"
        a.T = min(a.T, 32768)
    run([a.ash, "init", "--out", model, "--precision", "float"] + sets(model_sets(V, P, N, K)))
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    print(f"\n## Measured: ash grad on {list(models)[0]}, T = {a.T}, batch 1, float, 1 thread\n")
    print("| engine / lever | planned peak | measured peak | time (µs/token) |")
    print("|---|---|---|---|")
    files = {}
    variants = dict(LEVERS)
    variants["E3 + fp16 + checkpointing"] = ["grad.engine=adjoint-exact", "run.storage=fp16", "grad.layer_checkpoint=auto"]
    for lname, lv in variants.items():
        if lname.startswith("E1") and not a.quick:
            continue  # K·T·P·N·2 numbers: E1 at 64K tokens needs ~17 GiB and minutes; the plan gives its size
        gfile = os.path.join(a.out, re.sub(r"[^a-z0-9]+", "_", lname.lower()) + ".h5")
        cfg = [f"data.seq_len={a.T}", "data.batch=1"] + lv
        out = run([a.ash, "grad", "--checkpoint", model, "--tokens", corpus, "--out", gfile] + sets(cfg), env)
        us = float(re.search(r"\(([\d.]+) us/token\)", out).group(1))
        m = re.search(r"(\S+) peak ([\d.]+ \w+)", out)
        measured = to_bytes(m.group(2).split())
        planned = to_bytes(re.search(r"planned peak ([\d.]+ \w+)", out).group(1).split())
        files[lname] = gfile
        res["measured"][lname] = {"planned": planned, "measured": measured, "us_per_token": us}
        print(f"| {lname} | {fmt_bytes(planned)} | {fmt_bytes(measured)} | {us:.1f} |")
    try:
        import h5py  # noqa: F401
        print("\n## Gradient error of 16-bit storage against float storage (E3), per parameter group\n")
        print("| lever | group | 1 - cosine | relative L2 error |")
        print("|---|---|---|---|")
        for lname in ("E3 + bf16", "E3 + bf16 + checkpointing", "E3 + fp16 + checkpointing"):
            cmp = compare(files[lname], files["E3"])
            res["measured"][lname]["error"] = cmp
            for g, v in cmp.items():
                print(f"| {lname} | {g} | {1 - v['cosine']:.1e} | {v['rel']:.2e} |")
    except ImportError:
        print("(no h5py: gradient errors skipped; run with the test venv's python)")

    # 4. the main job with each storage
    if not a.skip_train and not a.quick:
        print("\n## The main job (examples/configs/fortunes.json, one process) with each storage\n")
        print("| run.storage | validation bits/byte at steps 100..600 | final loss | tokens/s |")
        print("|---|---|---|---|")
        for st in ("float", "bf16", "fp16"):
            d = os.path.join(a.out, f"train_{st}")
            subprocess.run(["rm", "-rf", d])
            out = run([a.ash, "train", "--config", os.path.join(ROOT, "examples", "configs", "fortunes.json"),
                       "--set", f"run.storage={st}", "--set", f"run.out_dir={d}", "--set", "run.ckpt_every=0",
                       "--set", f"data.train={corpus}"], env)
            rows = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
            val = [(r["step"], r["val_bits_per_token"]) for r in rows if "val_bits_per_token" in r]
            tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
            res["train"][st] = {"val": val, "final_loss": rows[-1]["loss"], "tokens_per_s": sorted(tps)[len(tps) // 2]}
            print(f"| {st} | {', '.join(f'{v:.3f}' for _, v in val)} | {rows[-1]['loss']:.4f} | "
                  f"{res['train'][st]['tokens_per_s']:.0f} |")
    with open(os.path.join(a.out, "memory_study.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"\nwrote {os.path.join(a.out, 'memory_study.json')}")


if __name__ == "__main__":
    main()
