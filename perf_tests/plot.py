#!/usr/bin/env python3
"""Plots of the perf suite (perf_tests/suite.sh) from its JSON lines.

    plot.py DIR [--where TEXT]
                       reads DIR/engines.jsonl (ash_bench_grad --json) and
                       DIR/torch.jsonl (torch_baseline.py --json), writes
                       DIR/memory_vs_context.png and DIR/time_per_token.png;
                       --where is added to the titles (e.g. "H100")

Memory: ash's rows are the Kokkos high-water mark of one gradient (parameters
and gradient buffers excluded); PyTorch's are the growth of the process RSS
over the step (peak minus the RSS before it: the import of torch alone is
several hundred MiB and is left out), on a GPU the growth of
torch.cuda.max_memory_allocated() over what the model and tokens hold. Both are against the context length T,
the paper's Fig. 1.
"""
import json
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def rows(path):
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(out):
    """{label: [(T, us_per_token, bytes)]} from both files."""
    d = Path(out)
    s = defaultdict(list)
    for r in rows(d / "engines.jsonl"):
        s[r["engine"]].append((r["T"], r["us_per_token"], r["peak_bytes"]))
    for r in rows(d / "torch.jsonl"):
        if r.get("oom"):
            continue  # the T that did not fit ends the sweep
        label = ("PyTorch chunked scan, GPU" if r.get("device", "cpu").startswith("cuda")
                 else f"PyTorch chunked scan, {r['threads']} thread(s)")
        s[label].append((r["T"], r["us_per_token"], max(0, r["peak_bytes"] - r["base_bytes"])))
    return {k: sorted(v) for k, v in s.items()}


def plot(data, col, ylabel, title, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in data.items():
        if label == "forward" and col == 2:
            continue  # the loss alone: not a gradient's memory
        style = "--" if label.startswith("PyTorch") else "-"
        ax.plot([p[0] for p in pts], [p[col] for p in pts], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length T (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print("wrote", path)


def main():
    args = sys.argv[1:]
    where = ""
    if len(args) == 3 and args[1] == "--where":
        where = f" ({args[2]})"
        args = args[:1]
    if len(args) != 1:
        sys.exit(__doc__)
    out = Path(args[0])
    data = series(out)
    if not data:
        sys.exit(f"no rows in {out}/engines.jsonl or {out}/torch.jsonl")
    plot({k: [(t, us, b / 2**20) for t, us, b in v] for k, v in data.items()}, 2, "peak memory (MiB)",
         "Peak memory of one gradient against context" + where, out / "memory_vs_context.png")
    plot(data, 1, "time per token (µs)", "Gradient time per token against context" + where,
         out / "time_per_token.png")


if __name__ == "__main__":
    main()
