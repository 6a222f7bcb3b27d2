#!/usr/bin/env python3
"""Registers, stack and static shared memory of the project's CUDA kernels, read from the
SASS (cuobjdump --dump-resource-usage), with the occupancy the registers allow on an
sm_90 GPU (H100/H200: 65,536 registers and 64 warps per SM). Registers only: whole teams
(blocks) round it down further, and shared memory may bound it too. The host-side part of the
GPU cost model: what ptxas gave each kernel, before a window measures it.

    kernel_resources.py --cuobjdump PATH --object FILE [--object FILE ...] [--filter REGEX] [--json OUT]

FILE: a CUDA object or library (build-gpu/work/ash-cuda/src/CMakeFiles/.../adjoint_exact.cpp.o,
the bundle's lib/libadjoint_sharding.so). Kernels are named by the function whose lambda
they are (Kokkos names a kernel by its functor), with the template arguments; one row per
distinct name and resource set. Needs c++filt (binutils).
"""
import argparse
import json
import re
import subprocess
import sys

REGS_PER_SM = 65536
WARPS_PER_SM = 64
REG_GRANULE = 8  # registers are allocated per thread in multiples of 8 (sm_90)


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.split("\n")[: len(names)]


def readable(dem):
    """The project function a Kokkos kernel's lambda belongs to, with its template arguments."""
    m = re.search(r"(ash::[\w:]+(?:<[^()<>]*(?:<[^()<>]*>[^()<>]*)*>)?)\(", dem)
    if m:
        return m.group(1)
    m = re.search(r"Parallel(?:For|Reduce|Scan)<([^,]+)", dem)
    return (m.group(1) if m else dem)[:160]


def occupancy(regs):
    per_warp = ((max(regs, 1) + REG_GRANULE - 1) // REG_GRANULE) * REG_GRANULE * 32
    warps = min(WARPS_PER_SM, REGS_PER_SM // per_warp)
    return warps, warps / WARPS_PER_SM


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuobjdump", required=True, help="cuobjdump from a CUDA toolkit")
    ap.add_argument("--object", action="append", required=True, help="a CUDA object or shared library")
    ap.add_argument("--filter", default="", help="keep kernels whose readable name matches this regex")
    ap.add_argument("--json", help="also write the rows as JSON lines")
    args = ap.parse_args()
    rows = {}
    for obj in args.object:
        res = subprocess.run([args.cuobjdump, "--dump-resource-usage", obj], capture_output=True, text=True)
        if res.returncode != 0:
            print(f"kernel_resources: cuobjdump failed on {obj}: {res.stderr.strip()}", file=sys.stderr)
            return 2
        lines = res.stdout.split("\n")
        found = []
        for i, line in enumerate(lines):
            m = re.match(r"\s*Function (\S+):\s*$", line)
            if m and i + 1 < len(lines):
                r = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", lines[i + 1])
                if r:
                    found.append((m.group(1), tuple(int(v) for v in r.groups())))
        for (mangled, (reg, stack, shared, local)), dem in zip(found, demangle([f[0] for f in found])):
            name = readable(dem)
            if args.filter and not re.search(args.filter, name):
                continue
            warps, occ = occupancy(reg)
            key = (name, reg, stack, shared, local)
            rows.setdefault(key, {"kernel": name, "registers": reg, "stack": stack, "static_shared": shared,
                                  "local": local, "max_warps_per_sm": warps, "occupancy_by_registers": occ,
                                  "count": 0})
            rows[key]["count"] += 1
    out = sorted(rows.values(), key=lambda r: (-r["registers"], r["kernel"]))
    print(f"{'registers':>9} {'stack':>5} {'local':>5} {'warps/SM':>8} {'occupancy':>9}  kernel")
    for r in out:
        print(f"{r['registers']:9d} {r['stack']:5d} {r['local']:5d} {r['max_warps_per_sm']:8d} "
              f"{r['occupancy_by_registers']:9.2f}  {r['kernel']}" + (f"  (x{r['count']})" if r["count"] > 1 else ""))
    if args.json:
        with open(args.json, "w") as f:
            for r in out:
                f.write(json.dumps(r) + "\n")
    return 0 if out else 1


if __name__ == "__main__":
    sys.exit(main())
