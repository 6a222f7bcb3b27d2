#!/usr/bin/env python3
"""The include order of docs/architecture.md: a folder of src/ash includes only
itself and the folders before it, core -> kernels -> model -> grad -> io -> plan
-> distributed -> train -> app (the front ends above them all). Exit 1 naming every include
that points upward."""
import os
import re
import sys

ORDER = ["core", "kernels", "model", "grad", "io", "plan", "distributed", "train", "app"]
RANK = {d: i for i, d in enumerate(ORDER)}


def main(src):
    bad, seen = [], 0
    for root, _, files in os.walk(os.path.join(src, "ash")):
        folder = os.path.relpath(root, os.path.join(src, "ash")).split(os.sep)[0]
        for f in sorted(files):
            path = os.path.join(root, f)
            if folder not in RANK:
                if f.endswith((".hpp", ".cpp")) and folder != ".":
                    bad.append(f"{path}: folder '{folder}' is not in the include order")
                continue
            seen += 1
            with open(path, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    m = re.match(r'\s*#\s*include\s+"ash/([a-z_]+)/', line)
                    if m and m.group(1) in RANK and RANK[m.group(1)] > RANK[folder]:
                        bad.append(f"{path}:{n}: {folder}/ includes {m.group(1)}/: {line.strip()}")
    if seen == 0:
        bad.append(f"no sources under {src}/ash")
    for b in bad:
        print(b)
    print(f"{seen} files checked, {len(bad)} upward include(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "src"))
