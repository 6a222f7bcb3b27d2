#!/usr/bin/env python3
"""Does the paper's gradient train as well as the exact one? (issue 12)

Trains the same byte-level model, from the same seed and in the same data
order, on the fortunes corpus with five gradients (docs/design.md §2):

  exact   E3, the gradient of the loss (adjoint-exact)
  paper   E3 --detach-inputs: the paper's full adjoint-sharding gradient
  t16/t64/t256  the paper's truncated gradient, window T̄ = 16, 64, 256

for each depth K and seed, then a long-context point (T = 8192, K = 4: exact,
paper, t256). The E3 forms give the paper's gradients in O(T), so the runs take
minutes; a few timed steps of E2 (`adjoint`, the paper's algorithm: T̄ VJPs per
token) add what each window costs the way the paper computes it. It writes every run's metrics.jsonl under --out, a summary
(summary.json, summary.md) and PNG plots of validation bits per byte against
steps and against training wall-clock (mean over seeds, min-max band).

  python3 examples/gradient_study.py               # the study (about an hour on 2 cores)
  python3 examples/gradient_study.py --quick       # smoke: every variant runs and logs

Runs that finished are reused (delete --out to start over); a run that stops
with an error (a diverged loss) is reported as diverged at its last step.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {
    "exact": {"grad.engine": "adjoint-exact"},
    "paper": {"grad.engine": "adjoint-exact", "grad.detach_inputs": "true"},
    "t16": {"grad.engine": "adjoint-exact", "grad.detach_inputs": "true", "grad.truncate": "16"},
    "t64": {"grad.engine": "adjoint-exact", "grad.detach_inputs": "true", "grad.truncate": "64"},
    "t256": {"grad.engine": "adjoint-exact", "grad.detach_inputs": "true", "grad.truncate": "256"},
}
LABELS = {"exact": "exact (E3)", "paper": "paper, full", "t16": "paper, T̄=16",
          "t64": "paper, T̄=64", "t256": "paper, T̄=256"}
COLORS = {"exact": "black", "paper": "tab:red", "t16": "tab:blue", "t64": "tab:green", "t256": "tab:orange"}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ash", default=os.path.join(os.environ.get("ASH_BUILD_DIR", os.path.join(ROOT, "build")),
                                                  "src", "ash"), help="the ash tool")
    ap.add_argument("--corpus", default=os.path.join(ROOT, "build", "data", "fortunes.txt"),
                    help="training text; built from /usr/share/games/fortunes when missing")
    ap.add_argument("--out", default=os.path.join(ROOT, "build", "study"), help="run directories and summary")
    ap.add_argument("--figures", default=None, help="where the PNGs go (default: --out)")
    ap.add_argument("--layers", default="2,4", help="depths K")
    ap.add_argument("--seeds", default="1,2,3", help="model.seed values (initialisation and data order)")
    ap.add_argument("--variants", default="exact,paper,t16,t64,t256")
    ap.add_argument("--seq-len", type=int, default=1024, help="T of the main study")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--long-seq-len", type=int, default=8192, help="T of the long-context point (0: skip it)")
    ap.add_argument("--long-layers", type=int, default=4)
    ap.add_argument("--long-steps", type=int, default=150)
    ap.add_argument("--long-seeds", default="1,2,3")
    ap.add_argument("--long-variants", default="exact,paper,t256")
    ap.add_argument("--e2-steps", type=int, default=6,
                    help="timed steps of E2 per detached variant (0: none); E2's full window is O(T^2), "
                         "so it is timed only up to T = 2048")
    ap.add_argument("--retime-steps", type=int, default=40,
                    help="after the runs, time this many steps of every variant (seed 1) one run at a time, "
                         "so the per-step times are not shared with another run (0: use the runs' own)")
    ap.add_argument("--jobs", type=int, default=2, help="runs at once (each one thread)")
    ap.add_argument("--quick", action="store_true", help="smoke: a few steps of tiny windows, one seed")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.seq_len, a.batch, a.steps, a.eval_every, a.seeds, a.layers = 64, 2, 4, 2, "1", "2"
        a.long_seq_len, a.long_layers, a.long_steps, a.long_seeds = 512, 2, 2, "1"
        a.e2_steps = 2
        a.retime_steps = 3
    return a


def ensure_corpus(path):
    if os.path.exists(path) and os.path.getsize(path) > 0:
        return
    src = "/usr/share/games/fortunes"
    if not os.path.isdir(src):
        sys.exit(f"gradient_study: no corpus at {path} and no {src} (apt-get install fortunes)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "wb") as out:
        for name in sorted(os.listdir(src)):
            f = os.path.join(src, name)
            if os.path.isfile(f) and not name.endswith((".dat", ".u8")):
                with open(f, "rb") as inp:
                    out.write(inp.read())
    os.replace(path + ".tmp", path)


def read_metrics(run_dir):
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return rows


def run_one(a, spec):
    """Trains one (group, K, variant, seed) unless a finished run is there."""
    d = spec["dir"]
    rows = read_metrics(d)
    status_path = os.path.join(d, "status.json")
    if rows and rows[-1]["step"] == spec["steps"] and os.path.exists(status_path):
        return spec
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    sets = {
        "model.layers": spec["K"], "model.seed": spec["seed"], "data.train": a.corpus,
        "data.seq_len": spec["T"], "data.batch": spec["B"], "optim.steps": spec["steps"],
        "run.out_dir": d, "run.eval_every": spec["eval_every"], "run.log_every": spec["eval_every"],
        "run.ckpt_every": 0,
    }
    sets.update(VARIANTS[spec["variant"]])
    if spec.get("e2"):  # E2 is always detached; only its window is set
        sets.pop("grad.detach_inputs", None)
        sets["grad.engine"] = "adjoint"
        sets["run.eval_every"] = 0
    cmd = [a.ash, "train", "--config", os.path.join(ROOT, "examples", "configs", "fortunes.json")]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    t0 = time.time()
    with open(os.path.join(d, "log.txt"), "w") as log:
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    with open(status_path, "w") as f:
        json.dump({"rc": rc, "wall_s": time.time() - t0, "command": cmd}, f)
    rows = read_metrics(d)
    last = rows[-1]["step"] if rows else 0
    print(f"[study] {spec['name']}: {'ok' if rc == 0 else f'exit {rc} (diverged?)'} at step {last}, "
          f"{time.time() - t0:.0f}s", flush=True)
    return spec


def plan(a):
    specs = []

    def add(group, K, variants, seeds, T, B, steps, eval_every):
        for v in variants:
            for s in seeds:
                name = f"{group}/K{K}/{v}/seed{s}"
                specs.append(dict(name=name, dir=os.path.join(a.out, name), group=group, K=K, variant=v,
                                  seed=s, T=T, B=B, steps=steps, eval_every=eval_every))
            # E2 timing: one seed, a few steps, the detached variants it can run in reasonable time
            if a.e2_steps > 0 and v != "exact" and (v != "paper" or T <= 2048):
                name = f"{group}/K{K}/{v}/e2"
                specs.append(dict(name=name, dir=os.path.join(a.out, name), group=group, K=K, variant=v,
                                  seed=seeds[0], T=T, B=B, steps=a.e2_steps, eval_every=0, e2=True))

    variants = a.variants.split(",")
    for v in variants + a.long_variants.split(","):
        if v not in VARIANTS:
            sys.exit(f"gradient_study: unknown variant '{v}' (one of {', '.join(VARIANTS)})")
    for K in [int(k) for k in a.layers.split(",")]:
        add("main", K, variants, [int(s) for s in a.seeds.split(",")], a.seq_len, a.batch, a.steps, a.eval_every)
    if a.long_seq_len > 0:
        add("long", a.long_layers, a.long_variants.split(","), [int(s) for s in a.long_seeds.split(",")],
            a.long_seq_len, 1, a.long_steps, max(1, a.long_steps // 6))
    return specs


def summarise(specs, retimed=None):
    """Per (group, K, variant): curves over seeds, final bits, step time."""
    retimed = retimed or {}
    groups, e2 = {}, {}
    for sp in specs:
        rows = read_metrics(sp["dir"])
        if sp.get("e2"):
            e2[(sp["group"], sp["K"], sp["variant"])] = (
                statistics.median([r["step_s"] for r in rows[1:]] or [r["step_s"] for r in rows] or [math.nan]))
            continue
        with open(os.path.join(sp["dir"], "status.json")) as f:
            rc = json.load(f)["rc"]
        ev = [r for r in rows if "val_bits_per_token" in r]
        key = (sp["group"], sp["K"], sp["variant"])
        g = groups.setdefault(key, dict(group=sp["group"], K=sp["K"], variant=sp["variant"], T=sp["T"],
                                        B=sp["B"], steps=sp["steps"], runs=[]))
        g["runs"].append(dict(
            seed=sp["seed"], rc=rc, last_step=rows[-1]["step"] if rows else 0,
            eval_steps=[r["step"] for r in ev],
            val_bits=[r["val_bits_per_token"] for r in ev],
            # first steps carry allocation and warm-up; the median ignores them anyway
            step_s=statistics.median([r["step_s"] for r in rows[2:]] or [r["step_s"] for r in rows] or [math.nan]),
            train_s=rows[-1]["train_s"] if rows else math.nan))
    out = []
    for key in sorted(groups, key=lambda k: (k[0] != "main", k[1], list(VARIANTS).index(k[2]))):
        g = groups[key]
        done = [r for r in g["runs"] if r["rc"] == 0 and r["last_step"] == g["steps"] and r["val_bits"]]
        finals = [r["val_bits"][-1] for r in done]
        g["finished"] = len(done)
        g["diverged"] = [dict(seed=r["seed"], step=r["last_step"]) for r in g["runs"] if r not in done]
        g["final_mean"] = statistics.mean(finals) if finals else math.nan
        g["final_std"] = statistics.stdev(finals) if len(finals) > 1 else 0.0
        g["step_s_shared"] = statistics.median([r["step_s"] for r in g["runs"]])
        g["step_s"] = retimed.get(key + (False,), g["step_s_shared"])
        g["e2_step_s"] = retimed.get(key + (True,), e2.get(key, math.nan))
        out.append(g)
    for g in out:  # relative to exact of the same group and depth
        ref = next((h for h in out if h["group"] == g["group"] and h["K"] == g["K"] and h["variant"] == "exact"), None)
        g["delta_vs_exact"] = g["final_mean"] - ref["final_mean"] if ref else math.nan
        g["time_vs_exact"] = g["step_s"] / ref["step_s"] if ref else math.nan
    return out


def table(summary):
    lines = ["| run | K | T | variant | seeds | final val bits/byte (mean ± sd) | Δ vs exact | "
             "s/step E3 (median) | vs exact | s/step E2 | diverged |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in summary:
        div = ", ".join(f"seed {d['seed']} at step {d['step']}" for d in g["diverged"]) or "none"
        lines.append(f"| {g['group']} | {g['K']} | {g['T']} | {LABELS[g['variant']]} | {g['finished']}/{len(g['runs'])} | "
                     f"{g['final_mean']:.4f} ± {g['final_std']:.4f} | {g['delta_vs_exact']:+.4f} | "
                     f"{g['step_s']:.4f} | {g['time_vs_exact']:.2f} | "
                     f"{'–' if math.isnan(g['e2_step_s']) else format(g['e2_step_s'], '.4f')} | {div} |")
    return "\n".join(lines)


def plot(summary, figures):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for group, K in sorted({(g["group"], g["K"]) for g in summary}):
        gs = [g for g in summary if g["group"] == group and g["K"] == K]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for g in gs:
            runs = [r for r in g["runs"] if r["val_bits"]]
            if not runs:
                continue
            n = min(len(r["val_bits"]) for r in runs)  # a diverged run ends early
            steps = runs[0]["eval_steps"][:n]
            cols = list(zip(*[r["val_bits"][:n] for r in runs]))
            mean = [statistics.mean(c) for c in cols]
            lo, hi = [min(c) for c in cols], [max(c) for c in cols]
            # time axis: steps x the per-step median timed alone (the runs shared the cores)
            tmean = [st * g["step_s"] for st in steps]
            label = f"{LABELS[g['variant']]} ({len(runs)} seeds)"
            for ax, x in ((axes[0], steps), (axes[1], tmean)):
                ax.plot(x, mean, color=COLORS[g["variant"]], label=label, lw=1.6)
                ax.fill_between(x, lo, hi, color=COLORS[g["variant"]], alpha=0.15, lw=0)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("training time (s): steps x median step time, timed one run at a time")
        axes[0].set_ylabel("validation bits per byte")
        for ax in axes:
            ax.grid(alpha=0.3)
        # the first evaluations are far above the rest; show where the variants differ
        finals = [g["final_mean"] for g in gs if not math.isnan(g["final_mean"])]
        if finals:
            axes[0].set_ylim(min(finals) - 0.15, max(finals) + 1.2)
        axes[0].legend(fontsize=8)
        T, B = gs[0]["T"], gs[0]["B"]
        fig.suptitle(f"fortunes, V=256 P=64 N=16 K={K}, T={T}, batch {B}: validation (line: mean, band: min-max)")
        fig.tight_layout()
        path = os.path.join(figures, f"study_{group}_K{K}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main():
    a = parse_args()
    if not os.access(a.ash, os.X_OK):
        sys.exit(f"gradient_study: no ash tool at {a.ash} (build first, or --ash PATH)")
    ensure_corpus(a.corpus)
    if a.quick:  # the smoke test never reuses an earlier build's runs
        shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out, exist_ok=True)
    figures = a.figures or a.out
    os.makedirs(figures, exist_ok=True)
    specs = plan(a)
    print(f"[study] {len(specs)} runs into {a.out}, {a.jobs} at a time", flush=True)
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        list(pool.map(lambda sp: run_one(a, sp), specs))
    retimed = {}
    if a.retime_steps > 0:
        # One run at a time: the step times of the curves' runs were measured two
        # at a time (and with whatever else ran), these alone.
        print(f"[study] timing {a.retime_steps} steps of every variant, one run at a time", flush=True)
        for sp in specs:
            if sp["seed"] != specs[0]["seed"] and not sp.get("e2"):
                continue
            t = dict(sp, name="retime/" + sp["name"], dir=os.path.join(a.out, "retime", sp["name"]),
                     steps=min(sp["steps"], a.retime_steps), eval_every=0)
            run_one(a, t)
            rows = read_metrics(t["dir"])[2:]
            if rows:
                retimed[(sp["group"], sp["K"], sp["variant"], bool(sp.get("e2")))] = statistics.median(
                    r["step_s"] for r in rows)
    summary = summarise(specs, retimed)
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    md = table(summary)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    if not a.no_plots:
        for p in plot(summary, figures):
            print(f"[study] wrote {p}")
    # Every variant must have run and logged validation; a diverged run is a
    # finding, but in the smoke test (tiny, stable settings) it is a failure.
    missing = [g for g in summary if not any(r["val_bits"] for r in g["runs"])]
    if missing or (a.quick and any(g["diverged"] for g in summary)):
        sys.exit("gradient_study: runs without validation output: " +
                 ", ".join(f"{g['group']}/K{g['K']}/{g['variant']}" for g in summary
                           if g in missing or g["diverged"]))


if __name__ == "__main__":
    main()
