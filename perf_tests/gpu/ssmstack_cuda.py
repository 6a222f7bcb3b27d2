"""adjoint_sharding's Python module on the device it was built for (a CUDA build on a
GPU; gpu_run.sh stage B, step b_ssmstack_cuda), checked, then timed:

  check  SSMStack's forward and backward (torch.autograd.grad through it) against plain
         PyTorch autograd of the same layers on the same device (perf_tests/torch_baseline.py,
         the reference of python/tests/test_torch.py): float64 within --tol64 (1e-10), float32
         against that float64 reference within --tol32 (1e-4, the host test's bound); the
         grad() verb (checkpoint + token ids) against torch_baseline's whole model on the
         device in float64; a tensor on another device refused with an error naming it.
  sweep  SSMStack (E3) against PyTorch autograd of the same layers, forward + backward at
         batch 1, T = 2^14 ... 2^20: seconds, torch.cuda.max_memory_allocated, the library's
         own peak (Kokkos Views, which torch's allocator does not see), out-of-memory noted;
         a method stops growing T after a point over --point-cap or out of memory, and no
         point starts past --deadline.

    python perf_tests/gpu/ssmstack_cuda.py --out DIR [--quick] [--no-sweep] [--deadline S]

DIR gets check.json and sweep.jsonl (JSON lines). Exit 1 when a check fails, or when
the module is not a CUDA build (without --quick: the host dry run of gpu_run_smoke).
"""
import argparse
import json
import os
import sys
import time

import torch

import adjoint_sharding as ash
from adjoint_sharding.torch import SSMStack, LAYER_TENSORS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch_baseline as tb  # noqa: E402


def rel(a, b):
    return float((a.double() - b.double()).abs().max() / max(float(b.double().abs().max()), 1e-300))


def layer_names(K):
    return [f"layers/{k:03d}/{n}" for k in range(K) for n in LAYER_TENSORS]


def reference(stack, dtype, chunk):
    """torch_baseline's model holding the stack's layers (embedding and head unused), on the stack's device."""
    m = tb.SSMModel(17, stack.width, stack.state, stack.num_layers, dtype, chunk)
    with torch.no_grad():
        for name, arr in stack.arrays().items():
            m[name].copy_(torch.from_numpy(arr))
    return m.to(ash.device())


def reference_grads(m, K, y0, W, detach_inputs):
    """yK, dL/dy0 and dL/dθ_k by autograd of L = sum(W * yK) (detach_inputs: the paper's gradient)."""
    y0 = y0.detach().clone().requires_grad_(True)
    y = y0
    for k in range(K):
        y = y + (m.layer(y.detach(), k) - y.detach()) if detach_inputs else m.layer(y, k)
    names = layer_names(K)
    g = torch.autograd.grad((W * y).sum(), [y0] + [m[n] for n in names])
    return y.detach(), g[0], dict(zip(names, g[1:]))


def stack_grads(stack, y0, W):
    y0 = y0.detach().clone().requires_grad_(True)
    yK = stack(y0)
    params = list(stack.parameters())
    g = torch.autograd.grad((W * yK).sum(), [y0] + params)
    return yK.detach(), g[0], {n.replace(".", "/"): t for (n, _), t in zip(stack.named_parameters(), g[1:])}


def check_stack(dev, dtype, tol, detach_inputs, levers, results):
    P, N, K, B, T, chunk = 8, 4, 3, 2, 37, 4
    s64 = SSMStack(P, N, K, dtype=torch.float64, seed=5, chunk=chunk, detach_inputs=detach_inputs, **levers)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # off the special values (norm = 1, D = 1, ...)
        for p in s64.parameters():
            p.add_(0.3 * (2 * torch.rand(p.shape, generator=gen, dtype=torch.float64) - 1))
    stack = SSMStack(P, N, K, dtype=dtype, chunk=chunk, detach_inputs=detach_inputs, _params=s64.arrays(),
                     **levers).to(dev)
    y0 = torch.randn(B, T, P, dtype=torch.float64, generator=gen).to(dev)
    W = torch.randn(B, T, P, dtype=torch.float64, generator=gen).to(dev)
    yK, gy0, gp = stack_grads(stack, y0.to(dtype), W.to(dtype))
    ryK, rgy0, rgp = reference_grads(reference(s64, torch.float64, chunk), K, y0, W, detach_inputs)
    assert yK.device == y0.device and gy0.device == y0.device and all(t.device == y0.device for t in gp.values())
    errs = {"yK": rel(yK, ryK), "dL/dy0": rel(gy0, rgy0)}
    errs.update({n: rel(gp[n], rgp[n]) for n in rgp})
    worst = max(errs, key=errs.get)
    name = f"stack_{str(dtype).split('.')[-1]}_{'paper' if detach_inputs else 'exact'}" + \
        "".join(f"_{k}{v}" for k, v in levers.items())
    results.append({"check": name, "passed": errs[worst] <= tol, "worst": worst, "rel_err": errs[worst],
                    "tol": tol, "device": str(y0.device)})


def check_grad_verb(dev, tol, tmp, results):
    """ash.grad (a checkpoint and token ids; the library's whole model) against
    torch_baseline's model on the device, float64."""
    V, P, N, K, B, T = 19, 8, 4, 2, 2, 33
    cfg = {"model": {"vocab": V, "width": P, "state": N, "layers": K, "seed": 3}, "grad": {"chunk": 4}}
    params = ash.init(cfg, "double")
    path = os.path.join(tmp, "ssmstack_cuda_grad.h5")
    ash.save(path, params, config=cfg, precision="double")
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    loss, grads = ash.grad(path, ids=ids.numpy(), precision="double")
    m = tb.SSMModel(V, P, N, K, torch.float64, 4)
    with torch.no_grad():
        for name in m.shapes:
            m[name].copy_(torch.from_numpy(params[name]))
    m = m.to(dev)
    names = list(m.shapes)
    rloss = m(ids.to(dev))
    rg = torch.autograd.grad(rloss, [m[n] for n in names])
    rl = float(rloss.detach())
    errs = {"loss": abs(loss - rl) / abs(rl)}
    errs.update({n: rel(torch.from_numpy(grads[n]), g.cpu()) for n, g in zip(names, rg)})
    worst = max(errs, key=errs.get)
    results.append({"check": "grad_verb_float64", "passed": errs[worst] <= tol, "worst": worst,
                    "rel_err": errs[worst], "tol": tol, "device": ash.device()})


def check_refusal(dev, results):
    """A tensor on another device than the build's is refused, by name, before anything runs."""
    other = "cpu" if dev.type != "cpu" else "meta"
    stack = SSMStack(8, 4, 2, dtype=torch.float64).to(dev)
    y_other = torch.zeros(1, 5, 8, dtype=torch.float64, device=other)
    y_dev = torch.zeros(1, 5, 8, dtype=torch.float64, device=dev)
    cases = [("SSMStack(y0 on another device)", lambda: stack(y_other), "y0 is on "),
             ("_core.stack_forward(yK on another device)",
              lambda: ash._core.stack_forward(stack._arrays(list(stack._params())), stack._options, y_dev, y_other),
              "yK must be a C-contiguous 3-D float64 array on " + ash.device()),
             ("_core.stack_forward(yK float32)",
              lambda: ash._core.stack_forward(stack._arrays(list(stack._params())), stack._options, y_dev,
                                              y_dev.float()),
              "yK must be a C-contiguous 3-D float64 array on " + ash.device())]
    for what, call, want in cases:
        try:
            call()
            ok, msg = False, "no error"
        except ash.Error as e:
            msg = str(e)
            ok = want in msg
        results.append({"check": "refuses " + what, "passed": ok, "message": msg[:300], "expected": want})


def timed(fn, reps):
    fn()  # warm-up (allocator, kernels' first launch)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def sweep(dev, args, out):
    P, N, K = args.width, args.state, args.layers
    stack = SSMStack(P, N, K, dtype=torch.float32, chunk=args.chunk).to(dev)
    ref = reference(stack, torch.float32, args.chunk)
    cuda = dev.type == "cuda"
    stopped = {}
    rows = []
    for T in args.T:
        for method in ("ash_ssmstack_e3", "torch_autograd"):
            row = {"method": method, "T": T, "batch": 1, "width": P, "state": N, "layers": K, "dtype": "float32",
                   "device": str(dev)}
            if method in stopped:
                row.update(status="skipped", reason=stopped[method])
            elif time.monotonic() > args.deadline_at:
                row.update(status="skipped", reason="deadline")
            else:
                gen = torch.Generator(device=dev).manual_seed(T)  # drawn on the device: 1 GiB at 2^20
                y0 = torch.randn(1, T, P, generator=gen, device=dev).requires_grad_(True)
                W = torch.randn(1, T, P, generator=gen, device=dev)
                params = list(stack.parameters()) if method.startswith("ash") else [ref[n] for n in layer_names(K)]

                def step():
                    if method.startswith("ash"):
                        y = stack(y0)
                    else:
                        y = y0
                        for k in range(K):
                            y = ref.layer(y, k)
                    torch.autograd.grad((W * y).sum(), [y0] + params)

                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(dev)
                ash._core.memory_reset_peak()
                try:
                    sec = timed(step, args.reps)
                    row.update(status="ok", seconds=sec, tokens_per_s=T / sec)
                    if sec > args.point_cap:
                        stopped[method] = f"T={T} took {sec:.1f} s > --point-cap {args.point_cap} s"
                except (torch.cuda.OutOfMemoryError, RuntimeError, ash.Error) as e:
                    oom = "out of memory" in str(e).lower() or isinstance(e, torch.cuda.OutOfMemoryError)
                    row.update(status="oom" if oom else "error", error=str(e).splitlines()[0][:300])
                    stopped[method] = f"{row['status']} at T={T}"
                if cuda:
                    row["torch_max_memory_allocated"] = torch.cuda.max_memory_allocated(dev)
                row["library_peak_bytes"] = ash._core.memory_peak()
                del y0, W
            rows.append(row)
            for stream in (out, sys.stdout):  # the file, and the step's log as it goes
                print(json.dumps(row), file=stream, flush=True)
    return rows


def parse_args():
    """The options; --quick shrinks the sweep to the host dry run's sizes."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="host dry run: any device, tiny sweep")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--tol64", type=float, default=1e-10)
    ap.add_argument("--tol32", type=float, default=1e-4)
    ap.add_argument("--deadline", type=float, default=150, help="seconds from the start: no sweep point starts after")
    ap.add_argument("--point-cap", type=float, default=20, help="a method stops growing T after a point this slow")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--T", default=",".join(str(2 ** e) for e in range(14, 21)))
    args = ap.parse_args()
    args.deadline_at = time.monotonic() + args.deadline
    if args.quick:
        args.width, args.state, args.layers, args.chunk, args.reps = 16, 4, 2, 8, 1
        args.T = "64,256"
    args.T = [int(t) for t in args.T.split(",")]
    return args


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(ash.device())
    print(f"adjoint_sharding on {dev} (Kokkos {ash.backend}); torch {torch.__version__}, "
          f"cuda available: {torch.cuda.is_available()}", flush=True)
    results = []
    if dev.type != "cuda" and not args.quick:
        results.append({"check": "the module is a CUDA build", "passed": False, "device": str(dev)})
    else:
        for dtype, tol in ((torch.float64, args.tol64), (torch.float32, args.tol32)):
            check_stack(dev, dtype, tol, False, {}, results)
        check_stack(dev, torch.float64, args.tol64, True, {}, results)
        check_stack(dev, torch.float64, args.tol64, False, {"layer_checkpoint": 2, "token_block": 16}, results)
        check_grad_verb(dev, args.tol64, args.out, results)
        check_refusal(dev, results)
    for r in results:
        print(("PASS " if r["passed"] else "FAIL ") + json.dumps(r), flush=True)
    passed = all(r["passed"] for r in results)
    with open(os.path.join(args.out, "check.json"), "w") as f:
        json.dump({"passed": passed, "device": str(dev), "checks": results}, f, indent=1)
    if passed and not args.no_sweep:
        with open(os.path.join(args.out, "sweep.jsonl"), "w") as f:
            sweep(dev, args, f)
    for p in os.listdir(args.out):  # the checkpoint of the grad check does not travel back
        if p.endswith(".h5"):
            os.remove(os.path.join(args.out, p))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
