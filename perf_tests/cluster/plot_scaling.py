#!/usr/bin/env python3
"""Plot of the scaling study (perf_tests/cluster/scaling.sbatch) from its JSON lines.

    plot_scaling.py FILE.jsonl [--out scaling.png]

Left: wall time of one gradient against the number of ranks, one line per
engine (and per T, when the file holds several); right: speedup over the
smallest rank count with the ideal line.
"""
import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("jsonl")
    ap.add_argument("--out", default="scaling.png")
    a = ap.parse_args()
    series = defaultdict(list)
    with open(a.jsonl) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                series[(r["engine"], r["T"], r["axis"])].append((r["ranks"], r["wall_s"]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    top = 1
    for (engine, T, axis), pts in sorted(series.items()):
        pts.sort()
        rs = [p[0] for p in pts]
        ws = [p[1] for p in pts]
        label = f"{engine}, T={T}"
        ax1.plot(rs, ws, marker="o", label=label)
        ax2.plot(rs, [ws[0] / w for w in ws], marker="o", label=label)
        top = max(top, rs[-1] / rs[0])
    ax2.plot([1, top], [1, top], "k:", label="ideal")
    for ax, y in ((ax1, "wall s per gradient"), (ax2, "speedup over the fewest ranks")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"{axis} ranks")
        ax.set_ylabel(y)
        ax.grid(True, which="both", alpha=0.3)
    ax1.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle("ash grad under srun")
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
