#!/usr/bin/env python3
"""Peak memory against context length (the paper's Fig. 1) from ash_bench_grad --json.

    python3 perf_tests/plot_memory.py BENCH.jsonl OUT.svg [--title TEXT]

Standard library only: writes an SVG with log-log axes, one line per engine.
"""
import json
import math
import sys
from collections import OrderedDict


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    title = argv[argv.index("--title") + 1] if "--title" in argv else "Peak memory of one gradient"
    series = OrderedDict()
    for line in open(argv[1]):
        r = json.loads(line)
        series.setdefault(r["engine"], []).append((r["T"], r["peak_bytes"] / 2**20))
    pts = [p for s in series.values() for p in s]
    if not pts:
        sys.exit("no rows in " + argv[1])
    W, H, L, R, TOP, B = 760, 480, 80, 220, 40, 60
    lx0, lx1 = math.log2(min(p[0] for p in pts)), math.log2(max(p[0] for p in pts))
    ly0, ly1 = math.floor(math.log10(min(p[1] for p in pts))), math.ceil(math.log10(max(p[1] for p in pts)))
    lx1 = lx1 if lx1 > lx0 else lx0 + 1

    def X(t):
        return L + (math.log2(t) - lx0) / (lx1 - lx0) * (W - L - R)

    def Y(m):
        return H - B - (math.log10(m) - ly0) / (ly1 - ly0) * (H - TOP - B)

    colors = ["#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#2ca02c", "#8c564b"]
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">' % (W, H),
           '<rect width="100%" height="100%" fill="white"/>',
           '<text x="%d" y="24" font-size="15">%s</text>' % (L, title)]
    for e in range(int(ly0), int(ly1) + 1):
        y = Y(10**e)
        out.append('<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>' % (L, y, W - R, y))
        out.append('<text x="%d" y="%.1f" text-anchor="end">%s MiB</text>' % (L - 6, y + 4, "{:g}".format(10**e)))
    for k in range(int(math.ceil(lx0)), int(lx1) + 1):
        x = X(2**k)
        out.append('<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#eee"/>' % (x, TOP, x, H - B))
        if k % 2 == 0:
            lab = "%dK" % (2**k // 1024) if 2**k >= 1024 else str(2**k)
            out.append('<text x="%.1f" y="%d" text-anchor="middle">%s</text>' % (x, H - B + 18, lab))
    out.append('<text x="%d" y="%d" text-anchor="middle">context length T (tokens)</text>' % ((L + W - R) // 2, H - 16))
    out.append('<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="black"/>' % (L, TOP, W - L - R, H - TOP - B))
    for i, (name, s) in enumerate(series.items()):
        c = colors[i % len(colors)]
        s = sorted(s)
        out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' %
                   (c, " ".join("%.1f,%.1f" % (X(t), Y(m)) for t, m in s)))
        for t, m in s:
            out.append('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"/>' % (X(t), Y(m), c))
        y = TOP + 16 + 20 * i
        out.append('<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2"/>' % (W - R + 12, y - 4, W - R + 36, y - 4, c))
        out.append('<text x="%d" y="%d">%s</text>' % (W - R + 42, y, name))
    out.append("</svg>")
    open(argv[2], "w").write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv)
