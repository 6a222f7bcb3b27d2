#!/usr/bin/env python3
"""Scaling model of E4 (docs/design.md §2, "Scaling model"): time per step,
memory per rank and efficiency of one exact gradient (E3) on R x S x D ranks.

  measure  --ash ASH --out P.json     R = 1 runs of `ash eval` / `ash grad` at K = 1 and 8:
                                      per layer-token forward and backward times (exact and paper mode),
                                      the contention of concurrent processes, seq_factor (one S = 2 run)
  validate --ash ASH --profile P.json  1-4 rank runs of `ash grad` under mpiexec, 3 repetitions, the
                                      median and the fastest against the model's prediction
                                      (--from OUT.json: re-predict an earlier run's measurements)
  project  --profile P.json|h100      R x S x D up to 1,024 GPUs and 2^24 tokens; weak and strong
                                      scaling tables and figures, network as a parameter
  smoke                               project() on a tiny built-in profile, with checks that can fail

Model (every time in seconds; rows = Bd*Ts with Bd = ceil(B/D) windows, Ts = ceil(T/S) tokens):
  layer rank r holds k_r layers (K = qR + m: the first m hold q + 1).
  per layer and pass:  fwd(rows) = c0 + f*rows,   bwd(rows) = c0 + b*rows  (b: exact or paper mode);
      with S > 1 both times seq_factor (the range path's extra state-map and mu passes; measured at S = 2);
  head and embedding (fwd+bwd) h*rows on the critical path once.
  message:             msg(bytes) = alpha + bytes/beta       (blocking: never overlapped with compute)
  S = 1 and R*D > 1, E3 forward in nb token blocks (nb = 4R, blocks of whole 64-token chunks):
      lockstep pipeline, step i runs block i - r on every active rank r (a_i of them);
      step time = max_r(cost_r(block) + msg(Bd*blen*P*s)) * share(a_i*S*D)
  share(n) = max(1, n/cores) * (contention if n > 1): ranks on a machine with fewer cores than
  ranks split them, and concurrent processes slow each other (measured; 1 and cores = infinity
  for one GPU per rank).
  exact backward: the same pipeline with bwd (the reverse wavefront);
  paper backward: binomial broadcast of g, ceil(log2 R) * msg(rows*P*s), then the
      slowest rank's layers, max_r k_r*bwd(rows) (or total work / cores if shared).
  S > 1 (whole ranges, no token blocks): the layer ranks run one after another, and
      each layer adds an exclusive scan of its affine maps, ceil(log2 S) * msg(2*Bd*P*N*s)
      (recursive doubling; --exscan linear: S - 1 steps, Open MPI 4.1's chain),
      forward and backward; the hand-off between layer ranks is msg(rows*P*s).
  D*S > 1: the gradient shard is summed (allreduce, recursive halving/doubling):
      2*ceil(log2 n)*alpha + 2*(n-1)/n * shard*s/beta,  n = D*S.
  memory per rank (the planner's E3 terms, design.md §8; k = max k_r): s * [2*shard (parameters, gradient)
      + rows*P (g) + rows*(2P+2N+1) (one layer's projections)
      + max((k+1)*rows*P + head chunk, k*rows*P + E3 scratch)]  (the head's phase or the backward's),
      E3 scratch = wave of W tokens (3*Bd*W*P*N + cotangents) + 3*Bd*ceil(Ts/C)*P*N chunk carries;
  with token blocks (exact and paper mode alike: one pipeline): k+1 whole-window rows*P (inputs, g),
      k*nb*Bd*P*N block-start states, one block's projections, and the larger of the head's phase
      (the last rank's output, one head chunk) and a block's buffers (4 [Bd*blen, P], 2k carries,
      E3 scratch on blen tokens).
"""
import argparse, json, math, os, re, statistics, subprocess, sys, tempfile

H100 = {  # perf_tests/RESULTS.md "On an H100": bench model V=256 P=256 N=16 K=8, float, one gradient
    # 2^16 tokens in 0.187 s, 2^20 in 2.947 s (E3), forward 0.449 s at 2^20; the head is folded into the layers.
    "name": "H100 (bench model, RESULTS.md)", "V": 256, "P": 256, "N": 16, "K": 8, "scalar": 4, "C": 64,
    "f": 0.449 / 2**20 / 8, "b_exact": (2.808e-6 - 0.449 / 2**20) / 8, "b_paper": (2.808e-6 - 0.449 / 2**20) / 8,
    "h": 0.0, "c0": 0.003 / 16, "wave": "gpu", "cores": math.inf, "mem_bytes": 80e9 * 0.9,
    "seq_factor": 1.34,  # the range path's extra passes, as measured on the CI VM (not on a GPU)
}
TINY = {"name": "smoke profile", "V": 256, "P": 64, "N": 16, "K": 8, "scalar": 4, "C": 64, "f": 1e-7,
        "b_exact": 4e-7, "b_paper": 3e-7, "h": 2e-7, "c0": 1e-4, "wave": "gpu", "cores": math.inf,
        "mem_bytes": 80e9}
ANCHORS = [("LASP", 128, 4 * 2**20), ("LASP-2", 64, 2 * 2**20), ("ZeCO", 256, 8 * 2**20)]


def layer_counts(K, R):
    q, m = divmod(K, R)
    return [q + 1 if r < m else q for r in range(R)]


def params_per_layer(P, N):
    return P + P * P + P + P * N + 2 * N * P + P  # w, W_delta, b_delta, Alog, W_B, W_C, D


def msg(nbytes, net):
    return net["alpha"] + nbytes / net["beta"] if nbytes > 0 else 0.0


def scan_steps(S, net):  # MPI_Exscan: recursive doubling (MPICH, Open MPI 5) or a chain (Open MPI 4.1's basic)
    return 0 if S == 1 else (S - 1 if net.get("exscan") == "linear" else math.ceil(math.log2(S)))


def blocks(T, R, C):
    nb = min(4 * R, T)
    blen = -(-T // nb)
    blen = -(-blen // min(C, T)) * min(C, T)
    return -(-T // blen), min(blen, T)


def predict(pr, R, S, D, T, B=1, mode="exact", net=None):
    """Time per step (s), memory of the largest rank (bytes) and the parts."""
    net = net or {"alpha": 5e-6, "beta": 25e9}
    P, N, K, s, V = pr["P"], pr["N"], pr["K"], pr["scalar"], pr["V"]
    f, b, h, c0 = pr["f"], pr["b_" + mode], pr["h"], pr["c0"]
    if S > 1:  # the range path: a state-map scan forward and a mu pass backward on top of E3's work
        f, b = f * pr.get("seq_factor", 1.0), b * pr.get("seq_factor", 1.0)
    Bd, Ts = -(-B // D), -(-T // S)
    rows, ks = Bd * Ts, layer_counts(K, R)
    # ranks that share `cores` cores: n/cores when oversubscribed, times the contention of
    # concurrent processes (caches, memory bandwidth) once two or more run at once
    share = lambda n: max(1.0, n / pr["cores"]) * (pr.get("contention", 1.0) if n > 1 else 1.0)
    t = {"fwd": 0.0, "bwd": 0.0, "head": h * rows, "comm": 0.0, "allreduce": 0.0}
    # token blocks under mpiexec with S = 1 (4 per layer rank, also at R = 1 when D > 1); one process: none
    nb, blen = blocks(Ts, R, pr["C"]) if S == 1 and R * D > 1 else (1, Ts)
    if nb > 1:  # token blocks through the layer ranks (exact and paper mode forward; exact backward)
        m = msg(Bd * blen * P * s, net)
        for phase, cost in (("fwd", f), ("bwd", b)) if mode == "exact" else (("fwd", f),):
            for i in range(nb + R - 1):
                act = [r for r in range(R) if 0 <= i - r < nb]
                step = max(k * (c0 + cost * Bd * blen) for k in (ks[r] for r in act))
                t[phase] += step * share(len(act) * D)
                t["comm"] += m if R > 1 else 0.0
    else:  # whole ranges: one layer rank after the other, exclusive scans per layer when S > 1
        scan = scan_steps(S, net) * msg(2 * Bd * P * N * s, net)
        phases = (("fwd", f), ("bwd", b)) if mode == "exact" else (("fwd", f),)
        for phase, cost in phases:
            t[phase] += sum(k * (c0 + cost * rows) for k in ks) * share(S * D)
            t["comm"] += K * scan + (R - 1) * msg(rows * P * s, net)
    if mode == "paper":  # g broadcast once, then every layer rank differentiates its own layers
        t["comm"] += math.ceil(math.log2(R)) * msg(rows * P * s, net) if R > 1 else 0.0
        if S > 1:
            t["comm"] += K * scan_steps(S, net) * msg(2 * Bd * P * N * s, net)
        work = [k * (c0 + b * rows) for k in ks]
        t["bwd"] = max(max(work), sum(work) * S * D / pr["cores"])
    shard = max(ks) * params_per_layer(P, N) + V * P + P
    n = D * S
    if n > 1:
        t["allreduce"] = 2 * math.ceil(math.log2(n)) * net["alpha"] + 2 * (n - 1) / n * shard * s / net["beta"]
    total = sum(t.values())
    gpu = pr["wave"] == "gpu"
    W = min(Ts, max(1024, 2**24 // (Bd * P * N)) if gpu else 1024)  # E3's wave (grad.wave "auto")
    hc = min(rows, max(1024, 2**24 // V) if gpu else 1024)            # the head's chunk (grad.head_chunk "auto")
    k, C = max(ks), pr["C"]
    scratch = lambda Wv, Tv: 3 * Bd * Wv * P * N + Bd * Wv * (3 * P + 2 * N) + 3 * Bd * -(-Tv // C) * P * N
    proj = lambda r: r * (2 * P + 2 * N + 1)
    mem = 0.0
    if nb > 1:  # token blocks: whole-window layer inputs (and the last rank's output and g), per-block scratch
        seq = Bd * blen
        mem = s * (2 * shard + (k + 1) * rows * P + k * nb * Bd * P * N + proj(seq)
                   + max(rows * P + hc * (1 + 2 * P + V), 4 * seq * P + 2 * k * Bd * P * N + scratch(min(W, blen), blen)))
    if nb == 1:  # whole windows (token blocks serve the paper mode as the exact one: the same pipeline)
        mem = s * (2 * shard + rows * P + proj(rows) + max((k + 1) * rows * P + hc * (1 + 2 * P + V),
                                                          k * rows * P + scratch(W, Ts)))
    return {"time": total, "mem": mem, "parts": t, "blocks": nb}


# ---------------------------------------------------------------------------- measuring with `ash`
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
           OPENBLAS_NUM_THREADS="1")


def run(cmd, timeout=900):
    if os.geteuid() == 0:  # as root: ahead of other work on a shared machine (it still shares caches)
        cmd = ["nice", "-n", "-15"] + cmd
    out = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout}{out.stderr}")
    return out.stdout


def corpus(work, nbytes):
    path = os.path.join(work, "corpus.txt")
    src = "/usr/share/games/fortunes"
    text = b""
    if os.path.isdir(src):
        for name in sorted(os.listdir(src)):
            p = os.path.join(src, name)
            if os.path.isfile(p) and not name.endswith((".dat", ".u8")):
                text += open(p, "rb").read()
    text = text or b"the quick brown fox jumps over the lazy dog; a stitch in time saves nine.\n"
    while len(text) < nbytes:
        text += text
    open(path, "wb").write(text[:nbytes])  # exactly nbytes: `ash eval` reads the whole file
    return path


def init(ash, work, P, N, K, T, B):
    path = os.path.join(work, f"m_P{P}_N{N}_K{K}_T{T}_B{B}.h5")
    if not os.path.exists(path):
        run([ash, "init", "--set", f"model.width={P}", "--set", f"model.state={N}", "--set", f"model.layers={K}",
             "--set", f"data.seq_len={T}", "--set", f"data.batch={B}", "--precision", "float", "--out", path])
    return path


def ash_grad(ash, work, ck, tok, R=1, S=1, D=1, mode="exact"):
    n = R * S * D
    cmd = [ash, "grad", "--checkpoint", ck, "--tokens", tok, "--out", os.path.join(work, "g.h5"),
           "--engine", "adjoint-exact"] + (["--detach-inputs"] if mode == "paper" else [])
    if n > 1:
        cmd = ["timeout", "900", "mpiexec", "--oversubscribe", "-n", str(n)] + cmd + [
            "--set", f"dist.layer_ranks={R}", "--set", f"dist.seq_ranks={S}", "--set", f"dist.data_ranks={D}"]
    out = run(cmd)
    secs = float(re.search(r"^time ([0-9.]+) s", out, re.M).group(1))
    unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    peaks = [float(v) * unit[u] for v, u in re.findall(r"Host peak ([0-9.]+) ([KMG]?i?B)", out)]
    return secs, max(peaks) if peaks else float("nan")


def ash_eval(ash, ck, tok, T, B):
    out = run([ash, "eval", "--checkpoint", ck, "--tokens", tok, "--set", f"data.seq_len={T}",
               "--set", f"data.batch={B}"])
    return float(re.search(r"forward time [0-9.]+ s \(([0-9.]+) us/token", out).group(1)) * 1e-6 * T * B


def lastpid():
    return int(open("/proc/loadavg").read().split()[4])


def median3(fn, reps, spawn=300):
    """Median of reps runs that no other work disturbed: nothing else runnable before the run and
    fewer than `spawn` new processes during it (a compile elsewhere spawns many); up to 4*reps tries."""
    vals, tries = [], 0
    while len(vals) < reps and tries < 4 * reps:
        tries += 1
        quiet()
        p0 = lastpid()
        v = fn()
        if (lastpid() - p0) % 2**22 < spawn or tries == 4 * reps:
            vals.append(v)
    return statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals), [v[0] for v in vals]


def load():
    return os.getloadavg()[0]


def quiet(limit=15):
    """Wait (up to limit s) until no other process is runnable for 2 s; returns the seconds waited."""
    waited = 0.0
    while waited < limit:
        busy = 0
        for _ in range(10):
            busy = max(busy, int(open("/proc/loadavg").read().split()[3].split("/")[0]) - 1)
            subprocess.run(["sleep", "0.2"])
        if busy == 0:
            return waited
        waited += 2
    return waited


def measure(a):
    """f, b and h from one process at K = 1 and K (linear in K: slope = per layer, intercept = head)."""
    work = tempfile.mkdtemp()
    T, P, N = a.T, a.width, a.state
    tok = corpus(work, T)  # eval reads the whole file: exactly one window
    fit = {}
    for what in ("eval", "exact", "paper"):
        y = {}
        for K in (1, a.layers):
            ck = init(a.ash, work, P, N, K, T, 1)
            if what == "eval":
                y[K] = median3(lambda: (ash_eval(a.ash, ck, tok, T, 1), 0.0), a.reps)[0]
            else:
                y[K] = median3(lambda: ash_grad(a.ash, work, ck, tok, mode=what), a.reps)[0]
            print(f"# {what} K={K} T={T}: {y[K]:.3f} s (load {load():.2f})", flush=True)
        slope = (y[a.layers] - y[1]) / ((a.layers - 1) * T)
        fit[what] = (slope, y[1] / T - slope)  # per layer-token, per token (head and embedding)
    pr = {"name": f"CI VM one core (measured T={T})", "T": T, "V": 256, "P": P, "N": N, "K": a.layers, "scalar": 4, "C": 64,
          "f": fit["eval"][0], "b_exact": fit["exact"][0] - fit["eval"][0], "b_paper": fit["paper"][0] - fit["eval"][0],
          "h": fit["exact"][1], "c0": 0.0, "wave": "host", "cores": os.cpu_count(), "mem_bytes": 0.9 * 24 * 2**30,
          "measured": {k: {"per_layer_token": v[0], "per_token": v[1]} for k, v in fit.items()}}
    # contention: `cores` copies of the K-layer gradient at once against one
    ck = init(a.ash, work, P, N, a.layers, T, 1)
    one = lambda i: [a.ash, "grad", "--checkpoint", ck, "--tokens", tok, "--out", os.path.join(work, f"c{i}.h5"),
                     "--engine", "adjoint-exact"]
    def together():
        procs = [subprocess.Popen(one(i), env=ENV, stdout=subprocess.PIPE, text=True) for i in range(pr["cores"])]
        return statistics.mean(float(re.search(r"^time ([0-9.]+) s", p.communicate()[0], re.M).group(1))
                               for p in procs), 0.0
    pr["contention"] = median3(together, a.reps)[0] / median3(lambda: ash_grad(a.ash, work, ck, tok), a.reps)[0]
    print(f"# {pr['cores']} processes at once: each {pr['contention']:.3f} x one alone", flush=True)
    # the range path (S > 1) against the whole window: one 1 x 2 x 1 run of the K-layer model
    t2 = median3(lambda: ash_grad(a.ash, work, ck, tok, 1, 2, 1), a.reps)[0]
    p = predict(pr, 1, 2, 1, T, 1, "exact", {"alpha": 2e-6, "beta": 5e9})["parts"]
    pr["seq_factor"] = (t2 - p["head"] - p["comm"] - p["allreduce"]) / (p["fwd"] + p["bwd"])
    print(f"# exact 1x2x1 K={a.layers} T={T}: {t2:.3f} s: seq_factor {pr['seq_factor']:.3f}", flush=True)
    json.dump(pr, open(a.out, "w"), indent=1)
    print(json.dumps(pr, indent=1))


VALIDATION = [  # (R, S, D, mode, T, B): the K = 8 model on 1-4 ranks
    (1, 1, 1, "exact", 16384, 1), (2, 1, 1, "exact", 16384, 1), (3, 1, 1, "exact", 16384, 1),
    (4, 1, 1, "exact", 16384, 1), (2, 1, 1, "paper", 16384, 1), (4, 1, 1, "paper", 16384, 1),
    (1, 2, 1, "exact", 16384, 1), (1, 4, 1, "exact", 16384, 1), (1, 1, 2, "exact", 8192, 2),
    (1, 1, 4, "exact", 4096, 4), (2, 2, 1, "exact", 16384, 1), (2, 1, 2, "exact", 8192, 2)]


def validate(a):
    """Predicted against measured; with --from, the measurements of an earlier run, re-predicted."""
    pr = json.load(open(a.profile))
    pr["K"] = a.layers
    net = {"alpha": a.latency, "beta": a.bandwidth}
    old = json.load(open(a.from_json)) if a.from_json else None
    if not old:
        work = tempfile.mkdtemp()
        tok = corpus(work, 16384 + 1)
    rows = []
    print("| R x S x D | role | mode | T | B | load | measured s (median; min) of 3 | predicted s | error (median; min) "
          "| peak MiB | predicted MiB | error |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (R, S, D, mode, T, B) in enumerate(VALIDATION):
        T //= a.shrink
        if old:
            row = old[i]
        else:
            ck = init(a.ash, work, pr["P"], pr["N"], a.layers, T, B)
            l0 = load()
            secs, peak, reps = median3(lambda: ash_grad(a.ash, work, ck, tok, R, S, D, mode), a.reps)
            row = {"R": R, "S": S, "D": D, "mode": mode, "T": T, "B": B, "measured_s": secs, "reps_s": reps,
                   "measured_peak": peak, "load": [l0, load()]}
        p = predict(pr, R, S, D, T, B, mode, net)
        row.update(predicted_s=p["time"], error=p["time"] / row["measured_s"] - 1, predicted_mem=p["mem"],
                   error_min=p["time"] / min(row["reps_s"]) - 1, mem_error=p["mem"] / row["measured_peak"] - 1,
                   role="calibration" if (R, D, mode, T) == (1, 1, "exact", pr["T"]) and S <= 2 else "prediction")
        rows.append(row)
        print(f"| {R}x{S}x{D} | {row['role']} | {mode} | {T} | {B} | {row['load'][0]:.2f} | {row['measured_s']:.3f}; "
              f"{min(row['reps_s']):.3f} | {p['time']:.3f} | {100 * row['error']:+.0f}%; {100 * row['error_min']:+.0f}% | "
              f"{row['measured_peak'] / 2**20:.1f} | {p['mem'] / 2**20:.1f} | {100 * row['mem_error']:+.1f}% |", flush=True)
    pred = [r for r in rows if r["role"] == "prediction"]
    for key in ("error", "error_min"):
        print(f"# predictions against the {'median' if key == 'error' else 'fastest run'}: max |error| "
              f"{100 * max(abs(r[key]) for r in pred):.0f}%, at 2 ranks "
              f"{100 * max(abs(r[key]) for r in pred if r['R'] * r['S'] * r['D'] <= 2):.0f}%")
    print(f"# max |memory error| {100 * max(abs(r['mem_error']) for r in rows):.1f}%")
    if a.out:
        json.dump(rows, open(a.out, "w"), indent=1)


# ---------------------------------------------------------------------------- projecting
def layouts(G, K, B):
    for R in range(1, min(K, G) + 1):
        if G % R:
            continue
        for D in range(1, min(B, G // R) + 1):
            if (G // R) % D == 0:
                yield R, G // (R * D), D


def best(pr, G, T, B, net, mode="exact"):
    cands = [(predict(pr, R, S, D, T, B, mode, net), (R, S, D)) for R, S, D in layouts(G, pr["K"], B)
             if S <= T]
    fits = [c for c in cands if c[0]["mem"] <= pr["mem_bytes"]] or cands
    return min(fits, key=lambda c: c[0]["time"])


def project(pr, nets, gpus, t_per_gpu, t_strong, B=1):
    out = {"profile": pr["name"], "weak": [], "strong": [], "reach": [], "anchors": []}
    for name, net in nets.items():
        one_w = predict(pr, 1, 1, 1, t_per_gpu, B, "exact", net)["time"]
        one_s = predict(pr, 1, 1, 1, t_strong, B, "exact", net)["time"]
        for G in gpus:
            p, lay = best(pr, G, t_per_gpu * G, B, net)
            out["weak"].append({"net": name, "G": G, "T": t_per_gpu * G, "layout": lay, "time": p["time"],
                                "mem": p["mem"], "eff": one_w / p["time"], "fits": p["mem"] <= pr["mem_bytes"]})
            p, lay = best(pr, G, t_strong, B, net)
            out["strong"].append({"net": name, "G": G, "T": t_strong, "layout": lay, "time": p["time"],
                                  "mem": p["mem"], "eff": one_s / (G * p["time"]), "fits": p["mem"] <= pr["mem_bytes"]})
            # the longest context that fits, all ranks on the sequence axis (memory falls as 1/S)
            lo, hi = 1, 2**40
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if predict(pr, 1, G, 1, mid, B, "exact", net)["mem"] <= pr["mem_bytes"] else (lo, mid)
            out["reach"].append({"net": name, "G": G, "T": lo, "time": predict(pr, 1, G, 1, lo, B, "exact", net)["time"]})
        for who, G, T in ANCHORS:  # this model at the (GPUs, T) other systems reported
            p, lay = best(pr, G, T, B, net)
            out["anchors"].append({"net": name, "system": who, "G": G, "T": T, "layout": lay, "time": p["time"],
                                   "mem": p["mem"]})
    return out


def check(res):
    """The numbers a scaling model must give; each failure is printed and counted."""
    bad = []
    for r in res["weak"] + res["strong"]:
        if not (0 < r["eff"] <= 1.0 + 1e-9 and r["time"] > 0 and r["mem"] > 0):
            bad.append(f"efficiency {r['eff']} or time {r['time']} or memory {r['mem']} out of range: {r}")
    pr = TINY
    mems = [predict(pr, R, 1, 1, 2**16)["mem"] for R in (1, 2, 4, 8)]
    if any(b >= a for a, b in zip(mems, mems[1:])):
        bad.append(f"memory per rank does not fall with R: {mems}")
    mems = [predict(pr, 1, S, 1, 2**20)["mem"] for S in (1, 2, 4, 8)]
    if any(b >= a for a, b in zip(mems, mems[1:])):
        bad.append(f"memory per rank does not fall with S: {mems}")
    slow, fast = (predict(pr, 1, 64, 1, 2**22, 1, "exact", {"alpha": 5e-6, "beta": bw})["time"] for bw in (25e9, 200e9))
    if not slow > fast:
        bad.append(f"a faster network is not faster: {slow} vs {fast}")
    for T, gib in ((2**16, 972.52 / 1024), (2**20, 12.32), (2**22, 48.71)):  # measured peaks, RESULTS.md "On an H100"
        got = predict(H100, 1, 1, 1, T)["mem"] / 2**30
        if abs(got / gib - 1) > 0.02:
            bad.append(f"memory of the bench model at T={T}: {got:.3f} GiB, measured {gib} GiB")
    t1, t2 = (predict(pr, 1, S, 1, 2**20)["time"] for S in (1, 2))
    if not t2 < t1:
        bad.append(f"two sequence ranks are not faster than one: {t2} vs {t1}")
    return bad


def figures(res, outdir):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.5))
    for net in sorted({r["net"] for r in res["weak"]}):
        w = [r for r in res["weak"] if r["net"] == net]
        s = [r for r in res["strong"] if r["net"] == net]
        c = [r for r in res["reach"] if r["net"] == net]
        ax[0].plot([r["G"] for r in w], [r["eff"] for r in w], "o-", label=f"weak, {net}")
        ax[0].plot([r["G"] for r in s], [r["eff"] for r in s], "s--", label=f"strong T=2^{int(math.log2(s[0]['T']))}, {net}")
        ax[1].plot([r["G"] for r in w], [r["time"] for r in w], "o-", label=f"weak {w[0]['T'] // w[0]['G']} tok/GPU, {net}")
        ax[1].plot([r["G"] for r in s], [r["time"] for r in s], "s--", label=f"strong, {net}")
        ax[2].plot([r["G"] for r in c], [r["T"] for r in c], "o-", label=f"longest T that fits, {net}")
    w = [r for r in res["weak"] if r["net"] == res["weak"][0]["net"]]
    ax[2].plot([r["G"] for r in w], [r["T"] for r in w], ":", color="gray", label="weak-scaling T")
    for name, G, T in ANCHORS:
        ax[2].plot([G], [T], "k*", ms=12)
        ax[2].annotate(f"{name} (reported)", (G, T), textcoords="offset points", xytext=(5, -12))
    for a, yl in zip(ax, ("parallel efficiency", "seconds per step (one gradient)", "context length T (tokens)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("GPUs (R x S x D ranks)")
        a.set_ylabel(yl)
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=7)
    ax[1].set_yscale("log")
    ax[2].set_yscale("log", base=2)
    ax[0].set_ylim(0, 1.05)
    fig.suptitle(f"E3 exact gradient, projected ({res['profile']}); stars: context lengths reported by other "
                 "systems on other models and hardware, not comparable runs", fontsize=9)
    fig.tight_layout()
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, "scaling_projection.png")
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--ash", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--T", type=int, default=16384)
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--width", type=int, default=64)
    m.add_argument("--state", type=int, default=16)
    m.add_argument("--reps", type=int, default=3)
    v = sub.add_parser("validate")
    v.add_argument("--ash", required=True)
    v.add_argument("--profile", required=True)
    v.add_argument("--layers", type=int, default=8)
    v.add_argument("--reps", type=int, default=3)
    v.add_argument("--latency", type=float, default=2e-6, help="MPI latency on this machine (shared memory), s")
    v.add_argument("--bandwidth", type=float, default=5e9, help="MPI bandwidth on this machine, bytes/s")
    v.add_argument("--shrink", type=int, default=1, help="divide every T by this (a quick check)")
    v.add_argument("--from", dest="from_json", help="re-predict the measurements of an earlier --out")
    v.add_argument("--out")
    for name in ("project", "smoke"):
        p = sub.add_parser(name)
        p.add_argument("--profile", default="h100" if name == "project" else "tiny",
                       help="h100 (RESULTS.md's bench-model numbers), tiny, or a measured profile JSON")
        p.add_argument("--gpus", default="1,2,4,8,16,32,64,128,256,512,1024")
        p.add_argument("--tokens-per-gpu", type=int, default=2**14)
        p.add_argument("--strong-T", type=int, default=2**24)
        p.add_argument("--bandwidths", default="25e9,200e9", help="bytes/s per link")
        p.add_argument("--latency", type=float, default=5e-6)
        p.add_argument("--exscan", default="log", help="log and/or linear (comma-separated): MPI_Exscan's steps")
        p.add_argument("--figures", help="folder for scaling_projection.png")
        p.add_argument("--json")
    a = ap.parse_args()
    if a.cmd == "measure":
        return measure(a)
    if a.cmd == "validate":
        return validate(a)
    pr = {"h100": H100, "tiny": TINY}.get(a.profile) or json.load(open(a.profile))
    nets = {f"{float(bw) / 1e9:g} GB/s" + ("" if ex == "log" else f", {ex} exscan"):
            {"alpha": a.latency, "beta": float(bw), "exscan": ex}
            for ex in a.exscan.split(",") for bw in a.bandwidths.split(",")}
    res = project(pr, nets, [int(g) for g in a.gpus.split(",")], a.tokens_per_gpu, a.strong_T)
    print(f"# profile: {pr['name']}; latency {a.latency * 1e6:g} us; memory limit {pr['mem_bytes'] / 1e9:.1f} GB")
    for kind in ("weak", "strong"):
        print(f"| {kind} | network | GPUs | T | R x S x D | s/step | memory/rank | efficiency |")
        print("|---|---|---|---|---|---|---|---|")
        for r in res[kind]:
            print(f"| {kind} | {r['net']} | {r['G']} | {r['T']} | {'x'.join(map(str, r['layout']))} | {r['time']:.4g} | "
                  f"{r['mem'] / 2**30:.2f} GiB{'' if r['fits'] else ' (does not fit)'} | {r['eff']:.3f} |")
    print("| reach | network | GPUs | longest T (1 x G x 1) | s/step |\n|---|---|---|---|---|")
    for r in res["reach"]:
        print(f"| reach | {r['net']} | {r['G']} | {r['T']} | {r['time']:.4g} |")
    print("| anchor | network | GPUs | T | R x S x D | s/step | memory/rank |\n|---|---|---|---|---|---|---|")
    for r in res["anchors"]:
        print(f"| {r['system']} (reported T) | {r['net']} | {r['G']} | {r['T']} | {'x'.join(map(str, r['layout']))} | "
              f"{r['time']:.4g} | {r['mem'] / 2**30:.2f} GiB |")
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)
    if a.figures:
        print("wrote", figures(res, a.figures))
    if a.cmd == "smoke":
        bad = check(res)
        for b in bad:
            print("FAIL:", b)
        print("smoke:", "FAILED" if bad else "ok")
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
