#!/usr/bin/env python3
"""A Mamba's gradient on the CPU: our E3 against transformers, side by side (issue 34, "Measured").

For each T: one gradient (forward + loss.backward()) of one window of T tokens, batch 1, float32,
of the same model in three ways, each in a child process of its own so that its peak is its own:

  slow     transformers' MambaForCausalLM, its pure-PyTorch path with the recurrent loop
           (use_mambapy=False; on a CPU the CUDA kernels are absent anyway)
  mambapy  the same model with use_mambapy=True (mamba.py's parallel scan, the `mambapy` package;
           refused, not silently the loop, where that package is not installed)
  ash      `ash grad --engine adjoint-exact` on the model imported by `ash import-hf` from the very
           folder transformers saved (identical weights) and the same tokens

    mamba_cpu_vs_hf.py [--T-list 4096,8192,16384,32768,65536] [--threads N] [--timeout S]
                       [--json OUT.jsonl] [--reps R] [--impls slow,mambapy,ash] [--ash build/src/ash]
                       [--mem-cap GIB] [--work DIR] [--width 256 --state 16 --layers 4 --vocab 256
                        --expand 2 --conv-kernel 4] [--seed 0] [--rtol 1e-4]

Per run: `seconds`, the wall time of the gradient alone (transformers: time.perf_counter() in the
child around forward + loss.backward(), after the model is loaded; ash: the `time` line `ash grad`
prints, its steady-clock time around the engine's compute, after the checkpoint and tokens are
loaded; neither has a warm-up pass: one gradient per process, as a training step's first), `peak`,
the child's peak RSS (VmHWM) after the gradient as the child reads it itself (transformers' child
from /proc/self/status, ash from the `process HWM` of its `memory:` line; wait4's ru_maxrss is not
used: Linux carries the parent's RSS at the fork into it) and, for transformers, `base`, its RSS
before the forward (torch, transformers and the model loaded), and `loss`. Losses must agree with the first finished
run's of the same T to --rtol (the same computation is compared): a mismatch is reported and the
exit status is 1. A run over --timeout seconds or over --mem-cap GiB of RSS (a watchdog polls the
child's VmRSS every 50 ms and kills it: the machine is shared, the kernel's OOM killer is not the
judge) is reported as such, not dropped, and larger T of that implementation are then not run;
nor is a T whose time or peak above base, extrapolated from the last two measured with their
measured growth (T^p, p >= 1; linear from one), would exceed --timeout or the cap (reported
"skipped", with the prediction). Tokens: id_i = (i * 2654435761 mod 2^64) mod V, as torch_baseline.py.
Prints one markdown table at the end (and --json: one JSON object per run).
--mutate (the smoke test's negative check) gives ash a model whose final norm weight is scaled by
1.1: the loss check must then fail (exit 1).
"""
import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
IMPLS = ("slow", "mambapy", "ash")
LABEL = {"slow": "transformers slow path", "mambapy": "transformers use_mambapy", "ash": "ash E3"}


def hf_config(a, use_mambapy):
    from transformers import MambaConfig
    return MambaConfig(vocab_size=a.vocab, hidden_size=a.width, state_size=a.state, num_hidden_layers=a.layers,
                       expand=a.expand, conv_kernel=a.conv_kernel, use_mambapy=use_mambapy,
                       tie_word_embeddings=True, use_cache=False)


def vm_kib(field, pid="self"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- the child processes ---------------------------------------------------------------------------

def child_init(a):
    """transformers' own initialisation of the model, saved in float32 (the folder ash imports)."""
    import torch
    from transformers import MambaForCausalLM
    torch.manual_seed(a.seed)
    save_model(a, MambaForCausalLM(hf_config(a, False)).to(torch.float32))


def save_model(a, model):
    """Saves transformers' model (and, with --mutate, the copy ash gets: its final norm scaled by 1.1,
    which the loss check must catch); prints its parameter count and the versions."""
    import torch
    import transformers
    model.save_pretrained(a.model_dir)
    if a.mutate:
        with torch.no_grad():
            model.backbone.norm_f.weight.mul_(1.1)
        model.save_pretrained(a.model_dir + "_mutated")
    print(json.dumps({"parameters": sum(p.numel() for p in model.parameters()), "torch": torch.__version__,
                      "transformers": transformers.__version__}))


def child_hf(a):
    import torch
    from transformers import MambaForCausalLM
    from transformers.models.mamba import modeling_mamba
    torch.set_num_threads(a.threads)
    mambapy = a.impl == "mambapy"
    if mambapy and not modeling_mamba.is_mambapy_available():
        # transformers would silently run the recurrent loop instead: not what this row claims
        sys.exit("mambapy is not installed: use_mambapy=True would run the slow path (pip install mambapy)")
    model = MambaForCausalLM.from_pretrained(a.model_dir, use_mambapy=mambapy, dtype=torch.float32)
    assert model.config.use_mambapy == mambapy and model.dtype == torch.float32
    model.train()
    timed_gradient(torch, model, read_ids(torch, a))


def read_ids(torch, a):
    """The first a.T tokens of a.tokens as a (1, T) id tensor."""
    import numpy as np
    ids = np.fromfile(a.tokens, dtype="<u4", count=a.T).astype(np.int64)
    return torch.from_numpy(ids).reshape(1, a.T)


def timed_gradient(torch, model, x):
    """One gradient of transformers' loss on x, timed; prints the child's JSON line."""
    base = vm_kib("VmRSS")
    t0 = time.perf_counter()
    out = model(input_ids=x, labels=x, use_cache=False)
    out.loss.backward()
    seconds = time.perf_counter() - t0
    grad_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    print(json.dumps({"loss": out.loss.item(), "seconds": seconds, "base_kib": base,
                      "hwm_kib": vm_kib("VmHWM"), "grads_finite": grad_ok, "threads": torch.get_num_threads()}))


# --- the parent -------------------------------------------------------------------------------------

def run_child(cmd, env, timeout, cap_kib):
    """Runs cmd; returns (status, stdout, stderr, last polled VmHWM KiB, wall s). status: ok, failed,
    timeout, memory (its RSS passed cap_kib: killed)."""
    out = tempfile.TemporaryFile("w+")
    err = tempfile.TemporaryFile("w+")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, text=True, start_new_session=True)
    status, hwm = None, 0
    while True:
        pid, st = os.waitpid(p.pid, os.WNOHANG)
        if pid == p.pid:
            break
        hwm = max(hwm, vm_kib("VmHWM", p.pid))
        if time.monotonic() - t0 > timeout:
            status = "timeout"
        elif cap_kib and vm_kib("VmRSS", p.pid) > cap_kib:
            status = "memory"
        if status is not None:
            os.killpg(p.pid, signal.SIGKILL)
            os.waitpid(p.pid, 0)
            break
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(st) if status is None else -9
    wall = time.monotonic() - t0
    out.seek(0)
    err.seek(0)
    o, e = out.read(), err.read()
    if status is None:
        status = "ok" if p.returncode == 0 else "failed"
    return status, o, e, hwm, wall


def mib(kib):
    return f"{kib / 1024:.0f} MiB" if kib else "-"


def common_args(ap, T_list, timeout, children):
    """The options this script and mamba2_cpu_vs_hf.py share (the sweep, the caps, the model's common sizes,
    the internal ones of the child processes)."""
    ap.add_argument("--T-list", default=T_list)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads and BLAS threads")
    ap.add_argument("--timeout", type=float, default=timeout, help="seconds per run (a child past it is killed)")
    ap.add_argument("--json", help="append one JSON object per run to this file")
    ap.add_argument("--reps", type=int, default=1, help="runs (processes) per point, to show the spread")
    ap.add_argument("--ash", default=os.path.join(ROOT, "build", "src", "ash"))
    ap.add_argument("--ash-set", action="append", default=[], help="extra --set KEY=VALUE for ash grad")
    ap.add_argument("--mem-cap", type=float, default=0,
                    help="GiB of RSS a child may reach (default: 80%% of MemAvailable at the start)")
    ap.add_argument("--work", help="folder for the model, tokens and gradients (default: a temporary one)")
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--expand", type=int, default=2)
    ap.add_argument("--conv-kernel", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rtol", type=float, default=1e-4, help="largest relative loss difference between runs")
    ap.add_argument("--mutate", action="store_true", help="ash gets a perturbed model: the check must fail")
    # internal: the child processes
    ap.add_argument("--child", choices=children, help=argparse.SUPPRESS)
    ap.add_argument("--impl", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--tokens", help=argparse.SUPPRESS)
    ap.add_argument("--T", type=int, help=argparse.SUPPRESS)


def prepare(a, me, sizes, n_tokens, import_ash, prog):
    """The caps, the work folder, the children's environment; the model once (transformers initialises
    and saves it in the child `me --child init`, ash imports that folder) and the tokens
    (id_i = i * 2654435761 mod 2^64 mod V). Returns (cap_kib, work, env, made, hf_dir, checkpoint, tokens)."""
    cap_kib = int((a.mem_cap * 2**30 if a.mem_cap else 0.80 * vm_kib_meminfo() * 1024) / 1024)
    work = a.work or tempfile.mkdtemp(prefix=prog + ".")
    os.makedirs(work, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads),
               MKL_NUM_THREADS=str(a.threads), TOKENIZERS_PARALLELISM="false")
    hf_dir, ck = os.path.join(work, "hf"), os.path.join(work, "model.h5")
    st, o, e, _, _ = run_child(me + ["--child", "init", "--model-dir", hf_dir] + sizes + ["--mutate"] * a.mutate,
                               env, 600, 0)
    if st != "ok":
        sys.exit(f"{prog}: saving transformers' model failed:\n{e}")
    made = json.loads(o.strip().splitlines()[-1])
    if import_ash:
        r = subprocess.run([a.ash, "import-hf", "--from", hf_dir + "_mutated" * a.mutate, "--out", ck,
                            "--precision", "float"], capture_output=True, text=True)
        if r.returncode:
            sys.exit(f"{prog}: ash import-hf failed:\n{r.stderr}")
    tokens = os.path.join(work, "tokens.u32")
    with open(tokens, "wb") as f:
        f.write(b"".join(((i * 2654435761) % 2**64 % a.vocab).to_bytes(4, "little") for i in range(n_tokens)))
    return cap_kib, work, env, made, hf_dir, ck, tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, "4096,8192,16384,32768,65536", 600, ("init", "hf"))
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--state", type=int, default=16)
    a = ap.parse_args()
    if a.child == "init":
        return child_init(a)
    if a.child == "hf":
        return child_hf(a)

    Ts = [int(t) for t in a.T_list.split(",")]
    impls = [i for i in a.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls or a.reps < 1 or a.threads < 1 or min(Ts) < 2:
        ap.error(f"--impls from {','.join(IMPLS)}; --reps, --threads >= 1; T >= 2 ({bad or ''})")
    if "ash" in impls and not os.access(a.ash, os.X_OK):
        ap.error(f"no ash executable at {a.ash} (--ash)")
    me = [sys.executable, os.path.abspath(__file__)]
    sizes = ["--width", str(a.width), "--state", str(a.state), "--layers", str(a.layers), "--vocab", str(a.vocab),
             "--expand", str(a.expand), "--conv-kernel", str(a.conv_kernel), "--seed", str(a.seed)]
    cap_kib, work, env, made, hf_dir, ck, tokens = prepare(a, me, sizes, max(Ts), "ash" in impls, "mamba_cpu_vs_hf")
    params = made["parameters"]

    head = (f"# model: transformers MambaForCausalLM V={a.vocab} D={a.width} N={a.state} K={a.layers} "
            f"expand={a.expand} Kc={a.conv_kernel} dt_rank=auto tied, {params} parameters, float32, batch 1; "
            f"seed {a.seed}\n# torch {made['torch']}, transformers {made['transformers']}, "
            f"{a.threads} thread(s); per-run cap {a.timeout:.0f} s, {cap_kib / 2**20:.1f} GiB RSS; work {work}")
    print(head, flush=True)
    rows, mismatches = sweep(a, impls, Ts, cap_kib, lambda impl, T: measure(a, impl, T, me, sizes, hf_dir, ck, tokens,
                                                                         work, env, cap_kib))
    print()
    print(head)
    print(table(rows, impls))
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    if mismatches:
        for r in mismatches:
            print(f"mamba_cpu_vs_hf: loss of {r['impl']} at T={r['T']} differs by {r['loss_rel_diff']:.2e} "
                  f"(relative) from the first run's: not the same computation", file=sys.stderr)
        return 1
    if not any(r["status"] == "ok" for r in rows):
        print("mamba_cpu_vs_hf: nothing was measured", file=sys.stderr)
        return 1
    return 0


def sweep(a, impls, Ts, cap_kib, run_point, alternate=False, budget=0):
    """Every T upward, each implementation a.reps times (run_point(impl, T) -> row); returns (rows,
    mismatches). alternate: the reps interleaved (rep 0: impls in order, rep 1: reversed, ...), so
    that a shared machine's slow spell hits both sides; else each implementation's reps in a row.
    An implementation stops after a timeout or out-of-memory run, and a point whose extrapolated
    time or memory passes the caps is skipped; budget: no run starts after that many seconds."""
    rows, mismatches = [], []
    stop = {}  # impl -> why larger T are not run
    done = {}  # impl -> [(T, seconds, peak above base KiB)] of its measured runs, one per T
    t_start = time.monotonic()
    for T in Ts:
        ref = None  # the first finished loss of this T
        order = ([(i, r) for r in range(a.reps) for i in (impls if r % 2 == 0 else impls[::-1])] if alternate
                 else [(i, r) for i in impls for r in range(a.reps)])
        skipped = set()  # impls skipped at this T: one row says why
        for impl, rep in order:
            if impl in skipped:
                continue
            row = {"impl": impl, "T": T, "rep": rep, "threads": a.threads}
            if impl in stop:
                row.update(status="skipped", why=stop[impl])
            elif budget and time.monotonic() - t_start > budget:
                row.update(status="skipped", why=f"the measurement budget of {budget:.0f} s was spent")
            elif predict(done.get(impl, []), T, 1) > a.timeout:
                row.update(status="skipped", why=f"predicted {predict(done[impl], T, 1):.0f} s > --timeout "
                                                 f"{a.timeout:.0f} s")
            elif cap_kib and predict(done.get(impl, []), T, 2) > cap_kib:
                row.update(status="skipped", why=f"predicted {predict(done[impl], T, 2) / 2**20:.1f} GiB > the "
                                                 f"cap {cap_kib / 2**20:.1f} GiB")
            else:
                row.update(run_point(impl, T))
            if row["status"] == "ok":
                if ref is None:
                    ref = row["loss"]
                row["loss_rel_diff"] = abs(row["loss"] - ref) / abs(ref)
                if row["loss_rel_diff"] > a.rtol:
                    mismatches.append(row)
                if not done.get(impl) or done[impl][-1][0] != T:
                    done.setdefault(impl, []).append((T, row["seconds"], row["peak_kib"] - row.get("base_kib", 0)))
            elif row["status"] in ("timeout", "memory") and impl not in stop:
                stop[impl] = f"T={T} ran out of {'time' if row['status'] == 'timeout' else 'memory'}"
            print(json.dumps(row), flush=True)
            rows.append(row)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            if row["status"] == "skipped":
                skipped.add(impl)
    return rows, mismatches


def predict(points, T, i):
    """Field i (1: seconds, 2: KiB above base) at T from the last two points' growth T^p (p >= 1)."""
    if not points:
        return 0
    t1, v1 = points[-1][0], points[-1][i]
    p = 1.0
    if len(points) > 1:
        t0, v0 = points[-2][0], points[-2][i]
        if v0 > 0 and v1 > 0 and t1 > t0:
            p = max(1.0, math.log(v1 / v0) / math.log(t1 / t0))
    return v1 * (T / t1) ** p


def vm_kib_meminfo():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    return 0


def measure(a, impl, T, me, sizes, hf_dir, ck, tokens, work, env, cap_kib):
    if impl == "ash":
        out = os.path.join(work, "grad.h5")
        cmd = [a.ash, "grad", "--checkpoint", ck, "--tokens", tokens, "--engine", "adjoint-exact",
               "--set", f"data.seq_len={T}", "--set", "data.batch=1", "--out", out]
        for s in a.ash_set:
            cmd += ["--set", s]
    else:
        cmd = me + ["--child", "hf", "--impl", impl, "--model-dir", hf_dir, "--tokens", tokens, "--T", str(T),
                    "--threads", str(a.threads)] + sizes
    st, o, e, peak, wall = run_child(cmd, env, a.timeout, cap_kib)
    if os.path.exists(os.path.join(work, "grad.h5")):
        os.remove(os.path.join(work, "grad.h5"))
    row = {"status": st, "peak_kib": peak, "process_s": round(wall, 3)}  # peak: the watchdog's last VmHWM
    if st != "ok":
        tail = (e or o).strip().splitlines()[-3:]
        row["why"] = {"timeout": f"over --timeout {a.timeout:.0f} s",
                      "memory": f"RSS over the cap {cap_kib / 2**20:.1f} GiB"}.get(st, " | ".join(tail))
        return row
    if impl == "ash":
        loss = re.search(r"^loss (\S+)$", o, re.M)
        secs = re.search(r"^time (\S+) s", o, re.M)
        if not (loss and secs):
            return dict(row, status="failed", why="no loss/time line in ash grad's output")
        row.update(loss=float(loss.group(1)), seconds=float(secs.group(1)))
        mem = re.search(r"^memory: (.*)$", o, re.M)
        hwm = re.search(r"process HWM ([0-9.]+) (B|KiB|MiB|GiB)", o)
        if not (mem and hwm):
            return dict(row, status="failed", why="no process HWM in ash grad's memory line")
        row["ash_memory"] = mem.group(1)
        row["peak_kib"] = round(float(hwm.group(1)) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024, "GiB": 2**20}[hwm.group(2)])
    else:
        r = json.loads(o.strip().splitlines()[-1])
        if not r["grads_finite"]:
            return dict(row, status="failed", why="a gradient is missing or not finite")
        row.update(loss=r["loss"], seconds=r["seconds"], base_kib=r["base_kib"], peak_kib=r["hwm_kib"])
    if not math.isfinite(row["loss"]):
        return dict(row, status="failed", why="loss not finite")
    return row


def table(rows, impls, labels=None):
    """One line per T: each implementation's time (median of the runs; min-max) and peak, and our ratios."""
    labels = labels or LABEL
    def cell(rs):
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            return None, None, (rs[0].get("why") or rs[0]["status"]) if rs else "-"
        s = [r["seconds"] for r in ok]
        med = statistics.median(s)
        spread = f" ({min(s):.3g}-{max(s):.3g}, {len(s)} runs)" if len(s) > 1 else ""
        peak = max(r["peak_kib"] for r in ok)
        return med, peak, f"{med:.3g} s{spread}, {mib(peak)}"
    hdr = ["T"] + [labels[i] for i in impls]
    both = "ash" in impls and any(i != "ash" for i in impls)
    if both:
        hdr += ["ash / faster HF: time", "ash / faster HF: peak"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for T in sorted({r["T"] for r in rows}):
        cells = {i: cell([r for r in rows if r["T"] == T and r["impl"] == i]) for i in impls}
        line = [str(T)] + [cells[i][2] for i in impls]
        if both:
            hf = [cells[i] for i in impls if i != "ash" and cells[i][0] is not None]
            ours = cells["ash"]
            if hf and ours[0] is not None:
                fast = min(hf, key=lambda c: c[0])  # the faster transformers path, and its peak
                line += [f"{ours[0] / fast[0]:.3f}", f"{ours[1] / fast[1]:.3f}"]
            else:
                line += ["-", "-"]
        lines.append("| " + " | ".join(line) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
