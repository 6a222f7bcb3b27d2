#!/usr/bin/env python3
"""Links mamba-ssm's `selective_scan_cuda` on the GPU machine from the bundle's objects.

perf_tests/gpu/bundle.sh compiles mamba-ssm's float selective-scan kernels for sm_90 (and
mamba_other_types.cpp) against torch 2.11.0's headers on a machine without a GPU; what
depends on the Python version, the pybind11 binding selective_scan.cpp, is compiled here
by torch.utils.cpp_extension against this machine's Python and torch, then linked with
those objects (about a minute). OUT then holds selective_scan_cuda*.so and mamba_ssm/,
the layout perf_tests/mamba_baseline.py --mamba-dir reads, and BUILD_INFO.json.

    mamba_link.py --bundle-mamba BUNDLE/mamba --out DIR

A check follows the link: mamba-ssm's selective_scan_fn on the GPU against its own
selective_scan_ref (float, small shapes, forward and gradients); exit 1 if they differ.
"""
import argparse
import glob
import json
import os
import shutil
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bundle-mamba", required=True, help="the bundle's mamba/ folder")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    src = os.path.abspath(args.bundle_mamba)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.join(out, "build"), exist_ok=True)
    info = json.load(open(os.path.join(src, "BUILD_INFO.json")))

    import torch
    from torch.utils import cpp_extension
    if torch.__version__.split("+")[0] != info["torch_headers"]:
        print(f"mamba_link: warning: the kernels were compiled against torch {info['torch_headers']}'s headers, "
              f"this is torch {torch.__version__}", flush=True)
    objs = sorted(glob.glob(os.path.join(src, "obj", "*.o")))
    if not objs:
        sys.exit(f"mamba_link: no objects in {src}/obj")
    t0 = time.time()
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"  # no .cu is compiled here; keeps cpp_extension quiet
    mod = cpp_extension.load(name="selective_scan_cuda", sources=[os.path.join(src, "csrc", "selective_scan.cpp")],
                             extra_cflags=["-O3"], extra_ldflags=objs, extra_include_paths=[os.path.join(src, "csrc")],
                             build_directory=os.path.join(out, "build"), with_cuda=True, verbose=False)
    seconds = round(time.time() - t0, 1)
    shutil.copy2(mod.__file__, out)
    if os.path.exists(os.path.join(out, "mamba_ssm")):
        shutil.rmtree(os.path.join(out, "mamba_ssm"))
    shutil.copytree(os.path.join(src, "mamba_ssm"), os.path.join(out, "mamba_ssm"))
    info.update({"linked_on_torch": torch.__version__, "python": sys.version.split()[0], "link_seconds": seconds,
                 "extension": os.path.basename(mod.__file__)})
    json.dump(info, open(os.path.join(out, "BUILD_INFO.json"), "w"), indent=1)
    print(f"mamba_link: selective_scan_cuda linked in {seconds} s: {os.path.join(out, os.path.basename(mod.__file__))}",
          flush=True)
    return check(out)


def check(out):
    """selective_scan_fn (the linked kernels) against selective_scan_ref on small float shapes."""
    import torch
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from mamba_baseline import import_mamba_scan  # the scan module alone, as the comparison imports it
    scan_fn, scan_ref, version, where = import_mamba_scan(out, need_cuda=True)
    print(f"mamba_link: mamba-ssm {version}, selective_scan_cuda from {where}", flush=True)
    torch.manual_seed(0)
    dev = "cuda"
    worst = 0.0
    for (b, d, n, L) in ((1, 8, 4, 64), (2, 16, 16, 1000)):
        u = torch.randn(b, d, L, device=dev, requires_grad=True)
        delta = (0.5 * torch.randn(b, d, L, device=dev)).requires_grad_()
        A = (-torch.rand(d, n, device=dev) - 0.5).requires_grad_()
        B = torch.randn(b, n, L, device=dev, requires_grad=True)
        C = torch.randn(b, n, L, device=dev, requires_grad=True)
        D = torch.randn(d, device=dev, requires_grad=True)
        bias = (0.1 * torch.randn(d, device=dev)).requires_grad_()
        ins = (u, delta, A, B, C, D, bias)
        outs = []
        for fn in (scan_fn, scan_ref):
            y = fn(u, delta, A, B, C, D=D, delta_bias=bias, delta_softplus=True)
            grads = torch.autograd.grad(y.square().sum(), ins)
            outs.append((y.detach(),) + tuple(g.detach() for g in grads))
        for x, r in zip(*outs):
            worst = max(worst, ((x - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
    print(f"mamba_link: selective_scan_fn against selective_scan_ref: worst relative difference {worst:.2e}", flush=True)
    if worst > 1e-3:
        print("mamba_link: the linked kernels disagree with mamba-ssm's reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
