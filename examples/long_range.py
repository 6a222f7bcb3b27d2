#!/usr/bin/env python3
"""Long-range recall: what the exact gradient learns (issue 22).

A key-value recall task the script generates itself (nothing is downloaded):
each window holds T = d + 8 tokens of random filler (16 symbols), a key (one of
4) and its value (one of 8: chance is 1/8) within the first 7 tokens, and the
same key again d tokens later, where the value must be predicted. The loss is
the cross-entropy at that query only: the filler is unpredictable by
construction, and scoring it would bury the one learnable target per window
under noise. Small models (K = 2 residual SSM layers of docs/design.md §1,
P = 16, N = 8) are trained with

  exact     E3, the gradient of the loss (adjoint-exact)
  paper     E3 with detached layer inputs: the paper's full gradient
  t256      the paper's truncated gradient, window T̄ = 256 (run where T > 256)
  t4096     the paper's truncated gradient, window T̄ = 4096 (run where T > 4096)
  backprop  plain reverse mode keeping every activation: the same layers in
            PyTorch autograd (perf_tests/torch_baseline.py); needs torch

Protocol (the same Adam settings, learning rate and batches for every gradient):
at the shortest d every gradient trains from the seeded initialisation; every
longer d starts from the model the exact gradient trained at the shortest d
(it knows the task at short range; its untrained recall at each d is measured
too), so what a gradient learns at d it learns from windows of length d. At the
largest d, extra runs start from the exact gradient's model at --extra-start
(a gradual extension). Recall accuracy is the arg max over the whole vocabulary
at the query, on held-out windows. Backprop trains where --backprop-max-d allows
and the planner says ash's backprop fits; past that, one short run measures its
time and memory.

The embedding, final norm, head and the Adam update are numpy; the K layers run
in C++ through adjoint_sharding's layer stack (the forward, and E3's backward
with the variant's detach and window; docs/python.md), called through the
package's binding _core.stack_forward / stack_backward as adjoint_sharding.torch
does, so that only backprop needs torch. Every run is a child
process, one at a time, with one thread; its peak resident memory growth over
its training steps is recorded. A float64 check first compares the training
loop's gradient with central differences and with PyTorch autograd.

    python examples/long_range.py                    # the study (about an hour on 2 cores)
    python examples/long_range.py --quick            # smoke (ctest long_range_smoke): fails unless
                                                     # the exact gradient learns the recall at d = 16
    python examples/long_range.py --plot-only        # plots from --json (needs matplotlib)

Writes perf_tests/figures/long_range.json (every run, a summary, the planner's
memory for ash's engines, the tables printed at the end) and, with matplotlib
(or --plot-python PY), long_range_accuracy.png and long_range_memory.png. Runs
already in --json with the same settings are reused (delete it to start over).
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "perf_tests"))
from proc_memory import reset_rss_peak, vm_kib  # noqa: E402  (no torch)
RMS_EPS = 1e-5  # docs/design.md §1

VARIANTS = {
    "exact": {"detach_inputs": False, "truncate": 0},
    "paper": {"detach_inputs": True, "truncate": 0},
    "t256": {"detach_inputs": True, "truncate": 256},
    "t4096": {"detach_inputs": True, "truncate": 4096},
    "backprop": {"detach_inputs": False, "truncate": 0, "torch": True},
}
LABELS = {"exact": "exact (E3)", "paper": "paper, full (E3 detached)", "t256": "paper, window 256",
          "t4096": "paper, window 4096", "backprop": "backprop (autograd)"}
COLORS = {"exact": "black", "paper": "tab:red", "t256": "tab:blue", "t4096": "tab:green",
          "backprop": "tab:gray"}


# ---------------------------------------------------------------- the task

class Task:
    """Token layout: filler 0..F-1, values F..F+nv-1, keys after them. vocab = F + nv + nk."""

    def __init__(self, filler=16, values=8, keys=4, margin=8):
        self.F, self.nv, self.nk, self.margin = filler, values, keys, margin
        self.vocab = filler + values + keys

    def spec(self):
        return {"filler": self.F, "values": self.nv, "keys": self.nk, "margin": self.margin}

    def seq_len(self, d):
        return d + self.margin

    def batch(self, rng, d, B):
        """tokens [B, T]: filler; key at a, value at a+1, key again at a+d (a < margin-1).

        Returns (tokens, query position a+d, target value)."""
        T = self.seq_len(d)
        x = rng.integers(0, self.F, size=(B, T), dtype=np.int64)
        a = rng.integers(0, self.margin - 1, size=B)
        k = self.F + self.nv + rng.integers(0, self.nk, size=B)
        v = self.F + rng.integers(0, self.nv, size=B)
        rows = np.arange(B)
        x[rows, a] = k
        x[rows, a + 1] = v
        x[rows, a + d] = k
        x[rows, a + d + 1] = v
        return x, a + d, v


# ---------------------------------------------------------------- the model

def rms(y, w):
    r = 1.0 / np.sqrt((y * y).mean(-1, keepdims=True) + RMS_EPS)
    return w * y * r, r


def head_loss(params, yq, targets, want_grad=True):
    """Cross-entropy of the head on the query rows yq [B, P]; grads of head, final_norm and yq."""
    w, Om = params["final_norm"], params["head"]
    yh, r = rms(yq, w)
    logits = yh @ Om.T
    m = logits.max(-1, keepdims=True)
    e = np.exp(logits - m)
    p = e / e.sum(-1, keepdims=True)
    B = yq.shape[0]
    rows = np.arange(B)
    loss = float(-np.log(p[rows, targets] + 1e-30).mean())
    correct = (logits.argmax(-1) == targets)
    if not want_grad:
        return loss, correct, None
    dl = p.copy()
    dl[rows, targets] -= 1.0
    dl /= B
    g = {"head": dl.T @ yh}
    dyh = dl @ Om
    g["final_norm"] = (dyh * yq * r).sum(0)
    z = dyh * w
    P = yq.shape[1]
    dy = r * z - (r ** 3) * yq * (z * yq).sum(-1, keepdims=True) / P
    return loss, correct, (g, dy)


class StackRunner:
    """The K layers: forward and E3 backward in C++ (adjoint_sharding._core)."""

    def __init__(self, core, P, N, K, vocab, detach_inputs, truncate, chunk):
        o = core.StackOptions()
        o.vocab, o.width, o.state, o.layers = vocab, P, N, K
        o.detach_inputs, o.truncate, o.chunk = bool(detach_inputs), int(truncate), int(chunk)
        self.core, self.o = core, o

    def forward(self, layer_params, y0):
        yK = np.empty_like(y0)
        self.core.stack_forward(layer_params, self.o, y0, yK)
        return yK

    def backward(self, layer_params, y0, g):
        """Layer gradients; g is overwritten with dL/dy0."""
        return self.core.stack_backward(layer_params, self.o, y0, g)


class TorchRunner:
    """The same K layers in plain PyTorch autograd (perf_tests/torch_baseline.py): backprop."""

    def __init__(self, P, N, K, vocab, chunk, double=False):
        import torch
        import torch_baseline as tb
        torch.set_num_threads(1)
        self.torch, self.tb = torch, tb
        self.m = tb.SSMModel(vocab, P, N, K, torch.float64 if double else torch.float32, chunk)
        self.K = K
        self._graph = None

    def _load(self, layer_params):
        with self.torch.no_grad():
            for name, arr in layer_params.items():
                self.m[name].copy_(self.torch.from_numpy(arr))

    def forward(self, layer_params, y0):
        torch = self.torch
        self._load(layer_params)
        y = torch.from_numpy(y0).requires_grad_(True)
        out = y
        for k in range(self.K):
            out = self.m.layer(out, k)
        self._graph = (y, out)
        return out.detach().numpy()

    def backward(self, layer_params, y0, g):
        torch = self.torch
        y, out = self._graph
        self.m.zero_grad(set_to_none=True)
        out.backward(torch.from_numpy(g))
        g[...] = y.grad.numpy()
        grads = {name: self.m[name].grad.numpy().copy() for name in layer_params}
        self._graph = None
        return grads


def evaluate(runner, params, task, d, n, seed, max_tokens=1 << 20):
    """Recall accuracy (arg max over the whole vocabulary at the query) and loss on n held-out windows."""
    rng = np.random.default_rng([seed, d, 7919])  # the same windows for every run at this d
    T = task.seq_len(d)
    per = max(1, min(n, max_tokens // T))
    layer_params = {k: params[k] for k in params if k.startswith("layers/")}
    correct, loss_sum, done = 0, 0.0, 0
    while done < n:
        b = min(per, n - done)
        x, q, v = task.batch(rng, d, b)
        yK = runner.forward(layer_params, np.ascontiguousarray(params["embedding"][x]))
        loss, c, _ = head_loss(params, yK[np.arange(b), q], v, want_grad=False)
        correct += int(c.sum())
        loss_sum += loss * b
        done += b
    return correct / n, loss_sum / n


def make_runner(core, variant, P, N, K, vocab, chunk, double=False):
    var = VARIANTS[variant]
    if var.get("torch"):
        return TorchRunner(P, N, K, vocab, chunk, double)
    return StackRunner(core, P, N, K, vocab, var["detach_inputs"], var["truncate"], chunk)


class Adam:
    """Adam with global-norm clipping, linear warm-up and cosine decay to 0.1·lr over each phase."""

    def __init__(self, params, lr, clip, b1=0.9, b2=0.95, eps=1e-8):
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.lr, self.clip, self.b1, self.b2, self.eps, self.t = lr, clip, b1, b2, eps, 0

    def step(self, params, grads, s, steps, warmup):
        norm = math.sqrt(sum(float(np.square(g, dtype=np.float64).sum()) for g in grads.values()))
        scale = min(1.0, self.clip / (norm + 1e-12)) if self.clip > 0 else 1.0
        lr = self.lr * min(1.0, (s + 1) / warmup) if warmup else self.lr
        if s >= warmup and steps > warmup:
            frac = (s - warmup) / max(1, steps - warmup)
            lr = self.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        self.t += 1
        c1, c2 = 1 - self.b1 ** self.t, 1 - self.b2 ** self.t
        for k, p in params.items():
            g = grads[k] * scale
            self.m[k] = self.b1 * self.m[k] + (1 - self.b1) * g
            self.v[k] = self.b2 * self.v[k] + (1 - self.b2) * g * g
            p -= lr * (self.m[k] / c1) / (np.sqrt(self.v[k] / c2) + self.eps)
        return norm


def loss_and_grads(runner, params, x, q, tgt):
    """Loss at the queries, recall hits, and the gradient of every parameter (embedding, K layers, head)."""
    B, P = x.shape[0], params["embedding"].shape[1]
    rows = np.arange(B)
    layer_params = {k: v for k, v in params.items() if k.startswith("layers/")}
    y0 = np.ascontiguousarray(params["embedding"][x])
    yK = runner.forward(layer_params, y0)
    loss, correct, (gh, dyq) = head_loss(params, yK[rows, q], tgt)
    g = np.zeros_like(y0)
    g[rows, q] = dyq  # the loss has a target at the query only
    grads = runner.backward(layer_params, y0, g)  # g becomes dL/dy0
    grads.update(gh)
    gE = np.zeros_like(params["embedding"])
    np.add.at(gE, x.reshape(-1), g.reshape(-1, P))
    grads["embedding"] = gE
    return loss, correct, grads


def train_run(spec, core, ash_init, log=None):
    """One run: from a saved model (spec["init_from"]) or from the seeded initialisation, `steps`
    Adam steps at distance d with the variant's gradient, then the recall accuracy at d."""
    task = Task(**spec["task"])
    P, N, K, d, B, steps = spec["width"], spec["state"], spec["layers"], spec["d"], spec["batch"], spec["steps"]
    ck = ash_init({"model": {"vocab": task.vocab, "width": P, "state": N, "layers": K, "seed": spec["seed"]}},
                  "float")
    params = {k: np.ascontiguousarray(np.asarray(ck[k], dtype=np.float32)) for k in ck.keys()}
    if spec.get("init_from"):
        with np.load(spec["init_from"]) as z:
            for k in params:
                params[k][...] = z[k]
    runner = make_runner(core, spec["variant"], P, N, K, task.vocab, spec["chunk"])
    opt = Adam(params, spec["lr"], spec["clip"])
    rng = np.random.default_rng([spec["seed"], d, 1])  # the same batches for every variant
    T = task.seq_len(d)
    # peak resident memory of the steps over the resident size before them (the first step's
    # one-time set-up included: PyTorch's, Kokkos')
    base_kib, hwm_reset = vm_kib("VmRSS"), reset_rss_peak()
    curve, acc_window, t_steps, done, loss = [], [], 0.0, 0, float("nan")
    for s in range(steps):
        x, q, tgt = task.batch(rng, d, B)
        t0 = time.perf_counter()
        loss, correct, grads = loss_and_grads(runner, params, x, q, tgt)
        opt.step(params, grads, s, steps, spec["warmup"])
        t_steps += time.perf_counter() - t0
        done = s + 1
        if not math.isfinite(loss):
            break
        acc_window.append(float(correct.mean()))
        if done % spec["log_every"] == 0 or done == steps:
            curve.append({"step": done, "loss": loss, "train_acc": sum(acc_window) / len(acc_window),
                          "train_s": t_steps})
            acc_window = []
            if log:
                log(f"step {done}: loss {loss:.3f}, train accuracy {curve[-1]['train_acc']:.3f}, {t_steps:.1f} s")
    peak_kib = vm_kib("VmHWM")
    out = {"steps_done": done, "T": T, "tokens_per_step": B * T, "train_s": t_steps,
           "s_per_step": t_steps / max(1, done), "curve": curve, "final_loss": loss,
           "finite": math.isfinite(loss), "rss_base_mib": base_kib / 1024, "rss_peak_mib": peak_kib / 1024,
           "rss_growth_mib": (peak_kib - base_kib) / 1024, "hwm_reset": hwm_reset}
    del runner
    if spec.get("save_to") and out["finite"]:
        np.savez(spec["save_to"] + ".tmp.npz", **params)
        os.replace(spec["save_to"] + ".tmp.npz", spec["save_to"])
    if spec.get("eval", 0) > 0 and out["finite"]:
        t0 = time.perf_counter()
        ev = StackRunner(core, P, N, K, task.vocab, False, 0, spec["chunk"])  # the forward is the same for all
        out["accuracy"], out["eval_loss"] = evaluate(ev, params, task, d, spec["eval"], spec["eval_seed"])
        out["eval_s"] = time.perf_counter() - t0
        if log:
            log(f"recall accuracy at d = {d}: {out['accuracy']:.3f} ({spec['eval']} held-out windows)")
    return out


def import_module():
    try:
        import adjoint_sharding  # noqa: F401
    except ImportError:
        build = os.environ.get("ASH_BUILD_DIR", os.path.join(ROOT, "build"))
        sys.path.insert(0, os.path.join(build, "python"))
    import adjoint_sharding as ash
    from adjoint_sharding import _core
    return ash, _core


def worker(spec_json):
    spec = json.loads(spec_json)
    ash, core = import_module()
    log = (lambda line: print(f"    {line}", file=sys.stderr, flush=True)) if spec.get("verbose") else None
    res = train_run(spec, core, ash.init, log)
    print("RESULT " + json.dumps(res), flush=True)


# ---------------------------------------------------------------- a gradient check

def check_gradients(with_torch):
    """float64: the training loop's loss gradient (numpy head and embedding around the C++ stack, E3
    exact) against central differences, and against backprop in PyTorch autograd. Returns the worst
    relative errors; raises when one is above its bound."""
    ash, core = import_module()
    task = Task(filler=6, values=4, keys=2, margin=4)
    P, N, K, d, B = 8, 4, 2, 12, 3
    ck = ash.init({"model": {"vocab": task.vocab, "width": P, "state": N, "layers": K, "seed": 5}}, "double")
    params = {k: np.ascontiguousarray(np.asarray(ck[k], dtype=np.float64)) for k in ck.keys()}
    rng = np.random.default_rng(3)
    for k in params:  # away from the initialisation's symmetric values (D = 1, norms = 1)
        params[k] += 0.05 * rng.standard_normal(params[k].shape)
    x, q, tgt = task.batch(rng, d, B)
    exact = StackRunner(core, P, N, K, task.vocab, False, 0, 4)
    _, _, grads = loss_and_grads(exact, {k: v.copy() for k, v in params.items()}, x, q, tgt)
    worst_fd = 0.0
    for name in ["embedding", "head", "final_norm", "layers/000/W_B", "layers/000/b_delta", "layers/000/A_log",
                 "layers/001/W_C", "layers/001/W_delta", "layers/000/norm"]:
        flat = params[name].reshape(-1)
        for i in rng.choice(flat.size, size=min(4, flat.size), replace=False):
            if name == "embedding":  # rows of tokens that occur
                i = int(x[0, q[0]]) * P + int(i) % P
            old, h = flat[i], 1e-6
            flat[i] = old + h
            lp = loss_and_grads(exact, params, x, q, tgt)[0]
            flat[i] = old - h
            lm = loss_and_grads(exact, params, x, q, tgt)[0]
            flat[i] = old
            fd, an = (lp - lm) / (2 * h), grads[name].reshape(-1)[i]
            worst_fd = max(worst_fd, abs(fd - an) / max(1e-3, abs(fd)))
    out = {"fd_rel_err": worst_fd}
    if worst_fd > 1e-5:
        raise SystemExit(f"long_range: gradient check failed: central differences differ by {worst_fd:.2e}")
    if with_torch:
        bp = TorchRunner(P, N, K, task.vocab, 4, double=True)
        _, _, gb = loss_and_grads(bp, {k: v.copy() for k, v in params.items()}, x, q, tgt)
        worst_bp = max(float(np.abs(gb[k] - grads[k]).max() / max(1e-12, np.abs(grads[k]).max())) for k in grads)
        out["backprop_rel_err"] = worst_bp
        if worst_bp > 1e-9:
            raise SystemExit(f"long_range: gradient check failed: backprop and E3 differ by {worst_bp:.2e}")
    return out


def eval_worker(spec_json):
    """The recall accuracy of a saved model at d, untrained there (the starting point of the runs)."""
    spec = json.loads(spec_json)
    _, core = import_module()
    task = Task(**spec["task"])
    with np.load(spec["model"]) as z:
        params = {k: np.ascontiguousarray(z[k]) for k in z.files}
    ev = StackRunner(core, spec["width"], spec["state"], spec["layers"], task.vocab, False, 0, spec["chunk"])
    acc, loss = evaluate(ev, params, task, spec["d"], spec["eval"], spec["eval_seed"])
    print("RESULT " + json.dumps({"accuracy": acc, "eval_loss": loss}), flush=True)


def start_accuracy(a, task, groups, seeds, env):
    """Each starting model's recall at the d it is trained at, before any step there."""
    out = []
    for d, start, _ in groups:
        if start is None:
            continue
        for seed in seeds:
            spec = {"task": task.spec(), "width": a.width, "state": a.state, "layers": a.layers, "chunk": a.chunk,
                    "d": d, "eval": a.eval, "eval_seed": a.eval_seed,
                    "model": os.path.join(a.out, f"seed{seed}_exact_d{start}.npz")}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--eval-worker", json.dumps(spec)],
                                  env=env, stdout=subprocess.PIPE, text=True)
            res = next((json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if res is not None:
                out.append(dict(d=d, start=start, seed=seed, **res))
        accs = [r["accuracy"] for r in out if r["d"] == d and r["start"] == start]
        if accs:
            print(f"[long_range] the exact gradient's model at d={start}, untrained at d={d}: recall "
                  f"{', '.join(f'{x:.2f}' for x in accs)}", flush=True)
    return out


# ---------------------------------------------------------------- ash's own engines, timed

ENGINES = {  # ash grad settings of the gradients above, for one gradient of ash's own engines
    "backprop": {"engine": "backprop"},
    "exact": {"engine": "adjoint-exact"},
    "t256": {"engine": "adjoint-exact", "detach_inputs": True, "truncate": 256},
    "t4096": {"engine": "adjoint-exact", "detach_inputs": True, "truncate": 4096},
}


def engine_worker(spec_json):
    """One `ash grad` through the module (adjoint_sharding.grad): a warm-up, then a timed one."""
    spec = json.loads(spec_json)
    ash, _ = import_module()
    task = Task(**spec["task"])
    cfg = {"model": {"vocab": task.vocab, "width": spec["width"], "state": spec["state"],
                     "layers": spec["layers"], "seed": 1}, "grad": {"chunk": spec["chunk"]}}
    ckpt = os.path.join(spec["out"], "engine_timing.h5")
    ash.save(ckpt, ash.init(cfg, "float"))
    x, _, _ = task.batch(np.random.default_rng([1, spec["d"], 3]), spec["d"], spec["batch"])
    tokens = x.reshape(-1).astype(np.uint32)
    kw = dict(ENGINES[spec["engine"]])
    engine = kw.pop("engine")
    base_kib, reset = vm_kib("VmRSS"), reset_rss_peak()
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        ash.grad(ckpt, tokens, seq_len=task.seq_len(spec["d"]), batch=spec["batch"], engine=engine, **kw)
        times.append(time.perf_counter() - t0)
    peak_kib = vm_kib("VmHWM")
    print("RESULT " + json.dumps({"s_per_grad": times[-1], "first_s": times[0], "hwm_reset": reset,
                                  "rss_growth_mib": (peak_kib - base_kib) / 1024}), flush=True)


def engine_timing(a, task, ds, variants, doc, env):
    """ash's own engines (E1 backprop, E3 exact, E3 detached with a window) on the same windows
    and batch as the runs at each d: the time and resident growth of one gradient of the loss
    over every target (`ash grad`), in a child process each."""
    out = []
    for d in ds:
        B = a.batch if a.start_d and d > a.start_d else a.scratch_batch  # as the runs at d
        for eng in ENGINES:
            if eng != "backprop" and eng not in variants:
                continue
            tr = ENGINES[eng].get("truncate", 0)
            if tr and task.seq_len(d) <= tr:
                continue
            spec = {"task": task.spec(), "width": a.width, "state": a.state, "layers": a.layers, "chunk": a.chunk,
                    "d": d, "batch": B, "engine": eng, "out": a.out}
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--engine-worker", json.dumps(spec)],
                                  env=env, stdout=subprocess.PIPE, text=True)
            res = next((json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if res is None:
                print(f"[long_range] ash grad timing d={d} {eng}: failed (exit {proc.returncode})", flush=True)
                continue
            out.append(dict(d=d, T=task.seq_len(d), batch=B, engine=eng, **res))
            print(f"[long_range] ash grad d={d} {ENGINES[eng]['engine']}{' T̄=' + str(tr) if tr else ''}: "
                  f"{res['s_per_grad']:.3f} s, +{res['rss_growth_mib']:.0f} MiB", flush=True)
    return out


# ---------------------------------------------------------------- the study

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", default="64,256,1024,4096,16384", help="distances d between the key and its query")
    ap.add_argument("--variants", default="exact,paper,t256,t4096,backprop")
    ap.add_argument("--seeds", default="1,2,3", help="model.seed values (initialisation and data)")
    ap.add_argument("--width", type=int, default=16, help="P")
    ap.add_argument("--state", type=int, default=8, help="N")
    ap.add_argument("--layers", type=int, default=2, help="K")
    ap.add_argument("--filler", type=int, default=16, help="filler symbols")
    ap.add_argument("--values", type=int, default=8, help="value symbols (chance = 1/values)")
    ap.add_argument("--keys", type=int, default=4, help="key symbols")
    ap.add_argument("--margin", type=int, default=8, help="T = d + margin; the key lies in the first margin-1 tokens")
    ap.add_argument("--lr", type=float, default=1e-2, help="Adam's peak learning rate (every run)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--chunk", type=int, default=64, help="E3's chunk length (grad.chunk)")
    ap.add_argument("--start-d", type=int, default=64,
                    help="every d above it starts from the model the exact gradient trained at this d (itself "
                         "trained from the seeded initialisation); 0: every run from the initialisation")
    ap.add_argument("--extra-start", type=int, default=1024,
                    help="at the largest d, also train from the exact gradient's model at this d (a gradual "
                         "extension; 0: no)")
    ap.add_argument("--extra-variants", default="exact,t4096", help="the gradients of those extra runs")
    ap.add_argument("--scratch-steps", type=int, default=200, help="steps of a run from the initialisation")
    ap.add_argument("--scratch-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60, help="steps of a run from a shorter distance's model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval", type=int, default=128, help="held-out windows scored per run")
    ap.add_argument("--eval-seed", type=int, default=99)
    ap.add_argument("--backprop-max-d", type=int, default=1024,
                    help="backprop trains every seed up to this d; past it (where the planner says ash's "
                         "backprop fits) one timed run of --timing-steps steps measures its time and memory")
    ap.add_argument("--timing-steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(os.environ.get("ASH_BUILD_DIR", os.path.join(ROOT, "build")),
                                                  "long_range"), help="saved models")
    ap.add_argument("--json", default=os.path.join(ROOT, "perf_tests", "figures", "long_range.json"))
    ap.add_argument("--figures", default=os.path.join(ROOT, "perf_tests", "figures"))
    ap.add_argument("--plot-python", default=None,
                    help="a Python with matplotlib for the plots when this one has none")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-engine-timing", action="store_true",
                    help="skip timing one gradient of ash's own engines (backprop E1, E3) at each d")
    ap.add_argument("--plot-only", action="store_true", help="only draw the plots from --json")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: d = 16 and 256, one seed, a gradient check; fails unless the exact "
                         "gradient learns the recall at d = 16")
    ap.add_argument("--verbose", action="store_true", help="every run's progress lines")
    a = ap.parse_args(argv)
    if a.quick:
        a.d, a.seeds, a.variants, a.start_d, a.extra_start = "16,256", "1", "exact,paper,t256,backprop", 16, 0
        a.scratch_steps, a.scratch_batch, a.steps, a.batch, a.eval = 120, 16, 20, 4, 128
        a.backprop_max_d, a.timing_steps = 16, 0
        if a.json == parse_args([]).json:
            a.json = os.path.join(a.out, "long_range_quick.json")
        if a.figures == parse_args([]).figures:
            a.figures = a.out
    return a


def command_args(argv):
    """The command line to record, without --plot-python's interpreter (a path of this machine)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == "--plot-python":
            skip = True
        elif not x.startswith("--plot-python="):
            out.append(x)
    return out


def has_module(python, module):
    return subprocess.call([python, "-c", f"import {module}"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL) == 0


def settings_of(a):
    keys = ["width", "state", "layers", "filler", "values", "keys", "margin", "lr", "warmup", "clip", "chunk",
            "start_d", "extra_start", "extra_variants", "scratch_steps", "scratch_batch", "steps", "batch", "eval", "eval_seed", "backprop_max_d",
            "timing_steps"]
    return {k: getattr(a, k) for k in keys}


def machine():
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.1f} GiB"


def plan_bytes(ash, a, vocab, T, B, engine, detach=False, truncate=0):
    cfg = {"model": {"vocab": vocab, "width": a.width, "state": a.state, "layers": a.layers},
           "data": {"seq_len": T, "batch": B},
           "grad": {"engine": engine, "detach_inputs": detach, "truncate": truncate, "chunk": a.chunk}}
    p = ash.plan(cfg, "grad", "float")
    return int(p["total"]), int(p["capacity"])


def study(a):
    ash, _ = import_module()
    ds = sorted(int(v) for v in a.d.split(","))
    seeds = [int(v) for v in a.seeds.split(",")]
    variants = [v for v in a.variants.split(",") if v]
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"long_range: unknown variant '{v}' (one of {', '.join(VARIANTS)})")
    if "exact" not in variants:
        variants.insert(0, "exact")  # the starting models of the longer distances come from it
    variants.sort(key=lambda v: list(VARIANTS).index(v))
    task = Task(a.filler, a.values, a.keys, a.margin)
    os.makedirs(a.out, exist_ok=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    settings = settings_of(a)
    doc = {}
    if os.path.exists(a.json):
        with open(a.json) as f:
            doc = json.load(f)
        if doc.get("settings") != settings:
            doc = {}  # other settings: start over
    runs = {(r["d"], r["variant"], r["seed"], r["start"]): r for r in doc.get("runs", [])}
    torch_ok = "backprop" not in variants or has_module(sys.executable, "torch")
    t_start = time.time()
    checks = check_gradients(torch_ok and "backprop" in variants)
    print(f"[long_range] gradient check (float64): central differences {checks['fd_rel_err']:.1e}"
          + (f", backprop vs E3 {checks['backprop_rel_err']:.1e}" if "backprop_rel_err" in checks else ""),
          flush=True)
    doc = {"what": "long-range key-value recall (examples/long_range.py, issue 22)",
           "command": " ".join(["python", "examples/long_range.py"] + command_args(sys.argv[1:])),
           "machine": machine(), "date": time.strftime("%Y-%m-%d"), "backend": ash.backend,
           "settings": settings, "task": task.spec(), "d": ds, "seeds": seeds, "variants": variants,
           "gradient_check": checks, "notes": [], "runs": [], "plan": []}
    capacity = None
    for d in sorted(set(ds) | {2 ** e for e in range(6, 21)}):
        T = task.seq_len(d)
        row = {"d": d, "T": T}
        for B, tag in ((a.batch, "ext"), (a.scratch_batch, "scratch")):
            row[f"e1_{tag}"], capacity = plan_bytes(ash, a, task.vocab, T, B, "backprop")
            row[f"e3_{tag}"], _ = plan_bytes(ash, a, task.vocab, T, B, "adjoint-exact")
        doc["plan"].append(row)
    doc["capacity_bytes"] = capacity
    plan_at = {r["d"]: r for r in doc["plan"]}
    if not torch_ok:
        doc["notes"].append("backprop skipped: this Python has no torch")
        variants = [v for v in variants if v != "backprop"]

    if a.start_d and a.start_d not in ds:
        raise SystemExit(f"long_range: --start-d {a.start_d} is not one of --d")
    extra = a.extra_start and a.extra_start != a.start_d and len(ds) > 1
    if extra and (a.extra_start not in ds or a.extra_start >= ds[-1]):
        raise SystemExit(f"long_range: --extra-start {a.extra_start} is not one of --d below the largest")
    todo = []
    groups = [(d, a.start_d if a.start_d and d > a.start_d else None, variants) for d in ds]
    if extra:
        groups.append((ds[-1], a.extra_start, [v for v in variants if v in a.extra_variants.split(",")]))
    for d, start, vs in groups:
        T = task.seq_len(d)
        for seed in seeds:
            for v in vs:
                tr = VARIANTS[v]["truncate"]
                if tr and T <= tr:
                    continue  # the window holds the whole sequence: this is the paper's full gradient
                spec = {"d": d, "variant": v, "seed": seed, "start": start, "timed_only": False}
                if v == "backprop":
                    tag = "scratch" if start is None else "ext"
                    need = plan_at[d][f"e1_{tag}"]
                    if need > capacity:
                        if seed == seeds[0]:
                            doc["notes"].append(f"backprop skipped at d = {d}: the planner puts ash's backprop "
                                                f"at {need / 2**30:.1f} GiB, above {capacity / 2**30:.1f} GiB")
                        continue
                    if d > a.backprop_max_d:
                        if seed != seeds[0] or a.timing_steps <= 0:
                            continue
                        spec["timed_only"] = True
                todo.append(spec)
    for d in ds:
        if d > a.backprop_max_d and "backprop" in variants and a.timing_steps > 0:
            doc["notes"].append(f"backprop at d = {d}: timed only ({a.timing_steps} steps, seed {seeds[0]}; "
                                f"its gradient is the exact one's, --backprop-max-d {a.backprop_max_d})")
    total_tokens = sum((a.timing_steps if s["timed_only"] else a.scratch_steps if s["start"] is None else a.steps)
                       * (a.scratch_batch if s["start"] is None else a.batch) * task.seq_len(s["d"])
                       for s in todo)
    print(f"[long_range] {len(todo)} runs, {total_tokens / 1e6:.1f} M training tokens; "
          f"d = {', '.join(map(str, ds))}; {', '.join(variants)}; seeds {', '.join(map(str, seeds))}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done_tokens = 0
    for i, s in enumerate(todo):
        key = (s["d"], s["variant"], s["seed"], s["start"])
        model = os.path.join(a.out, f"seed{s['seed']}_exact_d{s['d']}.npz")
        scratch = s["start"] is None
        steps = a.timing_steps if s["timed_only"] else a.scratch_steps if scratch else a.steps
        batch = a.scratch_batch if scratch else a.batch
        prev = runs.get(key)
        if prev and prev.get("ok") and (s["variant"] != "exact" or os.path.exists(model)):
            doc["runs"].append(prev)
            done_tokens += steps * batch * task.seq_len(s["d"])
            continue
        spec = {"task": task.spec(), "width": a.width, "state": a.state, "layers": a.layers, "seed": s["seed"],
                "variant": s["variant"], "d": s["d"], "steps": steps, "batch": batch, "lr": a.lr,
                "warmup": min(a.warmup, steps), "clip": a.clip, "chunk": a.chunk,
                "log_every": max(1, steps // 10), "eval": 0 if s["timed_only"] else a.eval,
                "eval_seed": a.eval_seed, "verbose": a.verbose,
                "init_from": None if scratch else os.path.join(a.out, f"seed{s['seed']}_exact_d{s['start']}.npz"),
                "save_to": model if s["variant"] == "exact" and s["start"] == groups[ds.index(s["d"])][1] else None}
        t0 = time.time()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                              env=env, stdout=subprocess.PIPE, text=True)
        res = None
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[7:])
        rec = dict(s, steps=steps, batch=batch, wall_s=time.time() - t0, ok=proc.returncode == 0 and res is not None)
        if res:
            rec.update(res)
        doc["runs"].append(rec)
        done_tokens += steps * batch * task.seq_len(s["d"])
        elapsed = time.time() - t_start
        eta = elapsed / max(1, done_tokens) * (total_tokens - done_tokens)
        acc = rec.get("accuracy")
        what = ("timed only" if s["timed_only"] else f"accuracy {acc:.3f}" if acc is not None
                else "FAILED" if not rec["ok"] else "diverged")
        print(f"[long_range] {i + 1}/{len(todo)} d={s['d']} {s['variant']} seed {s['seed']}"
              f" ({'scratch' if scratch else 'from d=' + str(s['start'])}): {what}, "
              f"{rec.get('s_per_step', float('nan')):.3f} s/step, +{rec.get('rss_growth_mib', float('nan')):.0f} MiB, "
              f"{rec['wall_s']:.0f} s  [elapsed {elapsed / 60:.1f} min, about {eta / 60:.0f} min left]", flush=True)
        with open(a.json + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
    doc["start_accuracy"] = start_accuracy(a, task, groups, seeds, env)
    if not a.no_engine_timing:
        print("[long_range] ash's own engines: one gradient (ash grad) on the same windows and batch", flush=True)
        doc["ash_grad"] = engine_timing(a, task, ds, variants, doc, env)
    doc["wall_s"] = time.time() - t_start  # this invocation (runs reused from --json not counted)
    doc["runs_wall_s"] = sum(r.get("wall_s", 0) for r in doc["runs"])
    doc["groups"] = [[d, st] for d, st, _ in groups]
    doc["summary"] = summarize(doc)
    doc["table_md"] = table_md(doc)
    with open(a.json + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(a.json + ".tmp", a.json)
    print(doc["table_md"])
    for n in doc["notes"]:
        print(f"[long_range] note: {n}")
    print(f"[long_range] wrote {a.json} ({doc['wall_s'] / 60:.1f} min)")
    return doc


def summarize(doc):
    """Per (variant, d, start): accuracy mean / min / max over seeds, s/step, peak memory growth."""
    out = []
    for d, start in doc["groups"]:
        for v in doc["variants"]:
            rs = [r for r in doc["runs"] if r["variant"] == v and r["d"] == d and r["start"] == start and r.get("ok")]
            if not rs:
                continue
            accs = [r["accuracy"] for r in rs if r.get("accuracy") is not None]
            out.append({"variant": v, "d": d, "T": rs[0]["T"], "seeds": len(rs), "start": start,
                        "timed_only": any(r["timed_only"] for r in rs),
                        "acc_mean": sum(accs) / len(accs) if accs else None,
                        "acc_min": min(accs) if accs else None, "acc_max": max(accs) if accs else None,
                        "s_per_step": sum(r["s_per_step"] for r in rs) / len(rs),
                        "rss_growth_mib": max(r["rss_growth_mib"] for r in rs),
                        "tokens_per_step": rs[0]["tokens_per_step"], "batch": rs[0]["batch"],
                        "steps": rs[0]["steps"]})
    return out


def table_md(doc):
    summ = {(r["variant"], r["d"], r["start"]): r for r in doc["summary"]}
    vs = doc["variants"]
    margin = doc["task"]["margin"]
    lines = ["| d | T | trained from | start model, untrained at d | " + " | ".join(LABELS[v] for v in vs) + " |",
             "|---|---|---|---|" + "---|" * len(vs)]
    time_lines = ["| d | trained from | " + " | ".join(LABELS[v] for v in vs) + " |",
                  "|---|---|" + "---|" * len(vs)]
    for d, start in doc["groups"]:
        cells, tcells = [], []
        for v in vs:
            r = summ.get((v, d, start))
            if r is None:
                tr = VARIANTS[v]["truncate"]
                same = tr and d + margin <= tr and (start is None or start + margin <= tr)
                cells.append("= paper" if same else "—")
                tcells.append("—")
                continue
            cells.append("timed only" if r["timed_only"] else
                         f"{r['acc_mean']:.2f} [{r['acc_min']:.2f}–{r['acc_max']:.2f}]")
            tcells.append(f"{r['s_per_step']:.3f} s, {r['rss_growth_mib']:.0f} MiB")
        st = "initialisation" if start is None else f"exact @ d={start}"
        s0 = [r["accuracy"] for r in doc.get("start_accuracy", []) if r["d"] == d and r["start"] == start]
        s0 = f"{sum(s0) / len(s0):.2f} [{min(s0):.2f}–{max(s0):.2f}]" if s0 else "—"
        lines.append(f"| {d} | {d + margin} | {st} | {s0} | " + " | ".join(cells) + " |")
        time_lines.append(f"| {d} | {st} | " + " | ".join(tcells) + " |")
    out = lines + ["", "Seconds per training step and peak memory growth of a step (max over seeds):", ""] + time_lines
    if doc.get("ash_grad"):
        engs = [e for e in ENGINES if any(r["engine"] == e for r in doc["ash_grad"])]
        names = {"backprop": "backprop (E1)", "exact": "exact (E3)", "t256": "E3, window 256",
                 "t4096": "E3, window 4096"}
        out += ["", "One gradient of ash's own engines (`ash grad`, the loss over every target) on the same "
                "windows and batch: seconds, resident growth:", "",
                "| d | batch | " + " | ".join(names[e] for e in engs) + " | planner: E1, E3 |",
                "|---|---|" + "---|" * len(engs) + "---|"]
        plan = {r["d"]: r for r in doc["plan"]}
        for d in doc["d"]:
            rs = {r["engine"]: r for r in doc["ash_grad"] if r["d"] == d}
            if not rs:
                continue
            B = next(iter(rs.values()))["batch"]
            st = doc["settings"]["start_d"]
            tag = "ext" if st and d > st else "scratch"
            cells = [f"{rs[e]['s_per_grad']:.3f} s, {rs[e]['rss_growth_mib']:.0f} MiB" if e in rs else "—"
                     for e in engs]
            out.append(f"| {d} | {B} | " + " | ".join(cells) + f" | {plan[d]['e1_' + tag] / 2**20:.0f} MiB, "
                       f"{plan[d]['e3_' + tag] / 2**20:.0f} MiB |")
    return "\n".join(out)


# ---------------------------------------------------------------- plots

def plots(doc, figures):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = doc["summary"]
    margin = doc["task"]["margin"]
    chance = 1.0 / doc["task"]["values"]
    sub = (f"K={doc['settings']['layers']}, P={doc['settings']['width']}, N={doc['settings']['state']}; "
           f"{doc['machine']}; {doc['date']}")
    main = {d: st for d, st in doc["groups"][:len(doc["d"])]}  # each d's first group: the main protocol

    def find(v, d, start):
        return next((x for x in summ if x["variant"] == v and x["d"] == d and x["start"] == start
                     and not x["timed_only"]), None)

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for j, v in enumerate(doc["variants"]):
        pts = []
        for d in doc["d"]:
            r = find(v, d, main[d])
            tr = VARIANTS[v]["truncate"]
            if r is None and tr and d + margin <= tr:  # identical to the paper's full gradient there
                r = find("paper", d, main[d])
            if r is not None and r["acc_mean"] is not None:
                pts.append((d * (1 + 0.04 * (j - 2)), r["acc_mean"], r["acc_min"], r["acc_max"]))  # apart
        if not pts:
            continue
        xs, ys, lo, hi = zip(*pts)
        ax.errorbar(xs, ys, yerr=[[y - l for y, l in zip(ys, lo)], [h - y for y, h in zip(ys, hi)]],
                    marker="o", capsize=3, color=COLORS[v], label=LABELS[v],
                    linestyle="--" if v == "backprop" else "-", alpha=0.9)
    for d, start in doc["groups"][len(doc["d"]):]:  # the extra runs: another starting model
        for i, v in enumerate(doc["variants"]):
            r = find(v, d, start)
            if r is not None and r["acc_mean"] is not None:
                x = d * (1.12 + 0.1 * i)
                ax.errorbar([x], [r["acc_mean"]], yerr=[[r["acc_mean"] - r["acc_min"]], [r["acc_max"] - r["acc_mean"]]],
                            marker="*", markersize=11, capsize=3, color=COLORS[v], ls="none",
                            label=f"{LABELS[v]}, from exact @ d={start}")
    ax.axhline(chance, color="gray", lw=0.8, ls=":", label=f"chance (1/{doc['task']['values']})")
    for tb in (256, 4096):
        if tb <= max(doc["d"]):
            ax.axvline(tb, color="gray", lw=0.6, ls="--")
            ax.text(tb, 1.02, f"window {tb}", ha="center", fontsize=8, color="gray")
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("distance d between the key and its query (tokens)")
    ax.set_ylabel("recall accuracy at the query (held-out)")
    ax.set_title("Key-value recall against distance, per gradient (mean, min-max over seeds)\n"
                 f"circles: d = {min(doc['d'])} from the initialisation, every longer d from the exact "
                 f"gradient's model at d = {main[max(doc['d'])]}", fontsize=9)
    ax.text(0.0, -0.16, sub, transform=ax.transAxes, fontsize=7, color="gray")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(os.path.join(figures, "long_range_accuracy.png"), dpi=120)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.6))
    for v in doc["variants"]:
        pts = [(r["d"], r["rss_growth_mib"], r["s_per_step"]) for r in summ
               if r["variant"] == v and r["start"] == main[r["d"]]]
        if pts:
            xs, mem, sps = zip(*pts)
            ax1.plot(xs, mem, marker="o", color=COLORS[v], label=LABELS[v] + " (measured)",
                     ls="--" if v == "backprop" else "-")
            ax2.plot(xs, sps, marker="o", color=COLORS[v], label=LABELS[v], ls="--" if v == "backprop" else "-")
    # the planner (ash plan --for grad) for ash's own engines at each studied d with the batch used
    # there, then on to 2^20 tokens at the extension runs' batch
    pl = {r["d"]: r for r in doc["plan"]}
    st = doc["settings"]["start_d"]
    first_ext = min([d for d in doc["d"] if st and d > st] or [max(doc["d"]) + 1])
    for eng, color, name in (("e1", "tab:gray", "ash backprop E1"), ("e3", "black", "ash exact E3")):
        xs = sorted(pl)
        ys = [pl[d][f"{eng}_scratch" if d < first_ext else f"{eng}_ext"] / 2 ** 20 for d in xs]
        ax1.plot(xs, ys, color=color, lw=1, ls=":", label=f"{name} (planner)")
    for eng, color, name in (("backprop", "tab:gray", "ash backprop E1"), ("exact", "black", "ash exact E3")):
        pts = [(r["d"], r["rss_growth_mib"], r["s_per_grad"]) for r in doc.get("ash_grad", []) if r["engine"] == eng]
        if pts:
            xs, mem, sec = zip(*pts)
            ax1.plot(xs, mem, color=color, marker="s", ls="none", mfc="none", label=f"{name} (measured, ash grad)")
            ax2.plot(xs, sec, color=color, marker="s", ls=":", mfc="none", label=f"{name} (one ash grad)")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("distance d (window T = d + %d tokens)" % margin)
        ax.grid(alpha=0.3)
    ax1.set_ylabel("peak memory of a training step (MiB)")
    ax1.set_title("Memory: measured RSS growth, and the planner", fontsize=10)
    ax2.set_ylabel("seconds per training step (squares: one ash grad)")
    ax2.set_title("Time (one core)", fontsize=10)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    ax1.text(0.0, -0.17, sub, transform=ax1.transAxes, fontsize=7, color="gray")
    fig.tight_layout()
    fig.savefig(os.path.join(figures, "long_range_memory.png"), dpi=120)
    plt.close(fig)
    return [os.path.join(figures, n) for n in ("long_range_accuracy.png", "long_range_memory.png")]


def draw(a, doc):
    if a.no_plots:
        return
    os.makedirs(a.figures, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        if a.plot_python:
            subprocess.check_call([a.plot_python, os.path.abspath(__file__), "--plot-only", "--json", a.json,
                                   "--figures", a.figures])
        else:
            print("[long_range] plots skipped: no matplotlib in this Python (--plot-python PYTHON, or "
                  "--plot-only under one that has it)", flush=True)
        return
    for p in plots(doc, a.figures):
        print(f"[long_range] wrote {p}")


def main(argv):
    a = parse_args(argv)
    if a.plot_only:
        with open(a.json) as f:
            doc = json.load(f)
        a.no_plots = False
        draw(a, doc)
        return 0
    doc = study(a)
    draw(a, doc)
    if a.quick:  # the smoke test: the pipeline ran, and the exact gradient learned the shortest distance
        d0 = min(doc["d"])
        bad = [x for x in doc["runs"] if not x.get("ok")]
        if bad:
            print(f"[long_range] FAILED: {len(bad)} run(s) did not finish", flush=True)
            return 1
        r = next(x for x in doc["summary"] if x["variant"] == "exact" and x["d"] == d0)
        if r["acc_mean"] < 0.9:
            print(f"[long_range] FAILED: the exact gradient's recall at d = {d0} is {r['acc_mean']:.2f} (< 0.9)")
            return 1
        print(f"[long_range] ok: the exact gradient recalls at d = {d0} with accuracy {r['acc_mean']:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--eval-worker":
        eval_worker(sys.argv[2])
        sys.exit(0)
    if len(sys.argv) == 3 and sys.argv[1] == "--engine-worker":
        engine_worker(sys.argv[2])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
