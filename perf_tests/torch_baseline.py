#!/usr/bin/env python3
"""A PyTorch user's baseline (CPU or CUDA) for the model of docs/design.md §1.

Times one forward + loss.backward() of the same model that `ash grad` and
`ash_bench_grad` differentiate, on the same synthetic tokens, written the way a
PyTorch user would: eager autograd, with the state recurrence as a chunked scan.

    torch_baseline.py [--T 1024,4096,16384] [--width 64 --state 16 --layers 2 --vocab 256]
                      [--batch 1] [--chunk 64] [--reps 3] [--threads 2] [--device cpu|cuda]
                      [--precision float|double] [--seed 1234] [--checkpoint CKPT]
                      [--json FILE] [--write-tokens FILE.u32]

--device cuda runs the same model on the GPU: times are taken between
torch.cuda.synchronize() calls, peak_bytes is torch.cuda.max_memory_allocated()
over the reps of one T (reset before each T), and a T that does not fit is
reported as "out of memory" (JSON "oom": true) and ends the sweep.

Tokens: id_i = (i * 2654435761 mod 2^64) mod V for i = 0 .. batch*T-1, window b is
ids [b*T, (b+1)*T), exactly as perf_tests/bench_grad.cpp. Parameters come from an
ash checkpoint (--checkpoint; its sizes override --width/--state/--layers/--vocab)
or from --seed with the distributions of design.md §1 (not bit-identical to ash's
initialisation, which uses its own Mersenne-twister transforms).

Checking the loss against ash on the same checkpoint and tokens (float, T = 1024):

    ash init --out /tmp/m.h5 --precision float --set model.width=64 \
        --set model.state=16 --set model.layers=2 --set model.vocab=256
    python3 perf_tests/torch_baseline.py --checkpoint /tmp/m.h5 --T 1024 \
        --write-tokens /tmp/ids.u32
    ash grad --checkpoint /tmp/m.h5 --tokens /tmp/ids.u32 \
        --set data.seq_len=1024 --set data.batch=1 --out /tmp/g.h5

The `loss` column of the first and the `loss` line of the second agree to float
rounding (relative ~1e-7 in float; identical in double with
`--precision double` on both).

Peak memory on the CPU: peak_bytes is the process RSS high-water mark (getrusage) over the
reps of one T, reset before each T through /proc/self/clear_refs where Linux
allows it (otherwise it is cumulative over the run; JSON peak_per_T says which);
base_bytes is the RSS before them (the torch import alone is several hundred
MiB). PyTorch keeps no allocator statistics on the CPU, so saved_bytes reports
what autograd itself holds for the backward pass: the distinct storages of the
saved tensors, measured on an untimed warm-up pass.
"""
import argparse
import json
import math
import resource
import statistics
import time

import h5py
import numpy as np
import torch
import torch.nn.functional as F

from proc_memory import reset_rss_peak

RMS_EPS = 1e-5  # design.md §1; not configurable in ash either


def rms_norm(y, w):
    return w * y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def chunked_scan(A, u, chunk):
    """h^t = A^t ⊙ h^{t-1} + u^t with h^0 = 0, for A, u of shape [B, T, P, N].

    Inside each chunk a Hillis–Steele doubling scan of the pairs (A, u) gives the
    cumulative decays and the states started from zero, in log2(chunk) steps of
    whole-tensor ops; a sequential pass over chunks then carries h across chunk
    boundaries. Only products of decays in [0, 1] and sums are formed, so decays
    that underflow to 0 stay exact. (The closed form P_t·(h0 + cumsum(u / P_t))
    overflows as soon as a chunk's Σ Δ·a drops below about −88, which the default
    initialisation already reaches at chunk 64: Δ up to 0.1, a down to −N.)
    """
    B, T, P, N = A.shape
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    if pad:  # identity steps at the end: A = 1, u = 0
        A = F.pad(A, (0, 0, 0, 0, 0, pad), value=1.0)
        u = F.pad(u, (0, 0, 0, 0, 0, pad))
    A = A.reshape(B, n_chunks, chunk, P, N)
    u = u.reshape(B, n_chunks, chunk, P, N)
    d = 1
    while d < chunk:
        u = u + A * F.pad(u[:, :, :-d], (0, 0, 0, 0, d, 0))
        A = A * F.pad(A[:, :, :-d], (0, 0, 0, 0, d, 0), value=1.0)
        d *= 2
    carry = [u.new_zeros(B, P, N)]
    for c in range(n_chunks - 1):
        carry.append(u[:, c, -1] + A[:, c, -1] * carry[-1])
    h = u + A * torch.stack(carry, 1)[:, :, None]
    return h.reshape(B, n_chunks * chunk, P, N)[:, :T]


class SSMModel(torch.nn.Module):
    """Parameters are named and shaped as the datasets under /params (docs/file_format.md)."""

    LAYER_SHAPES = {"norm": "P", "W_delta": "PP", "b_delta": "P", "A_log": "PN", "W_B": "NP", "W_C": "NP", "D": "P"}

    def __init__(self, vocab, width, state, layers, dtype, chunk):
        super().__init__()
        self.vocab, self.width, self.state, self.layers, self.chunk = vocab, width, state, layers, chunk
        size = {"P": width, "N": state}
        shapes = {"embedding": (vocab, width), "final_norm": (width,), "head": (vocab, width)}
        for k in range(layers):
            for name, dims in self.LAYER_SHAPES.items():
                shapes[f"layers/{k:03d}/{name}"] = tuple(size[c] for c in dims)
        self.shapes = shapes
        # nn.ParameterDict keys may not contain '/', hence the flat mangled names
        self.p = torch.nn.ParameterDict(
            {self._key(n): torch.nn.Parameter(torch.empty(s, dtype=dtype)) for n, s in shapes.items()})

    @staticmethod
    def _key(name):
        return name.replace("/", "__")

    def __getitem__(self, name):
        return self.p[self._key(name)]

    @torch.no_grad()
    def init_seeded(self, seed):
        g = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(self.width)

        def uniform(name, lo, hi):
            t = self[name]
            t.copy_(torch.rand(t.shape, generator=g, dtype=torch.float64) * (hi - lo) + lo)

        self["embedding"].copy_(torch.randn(self.shapes["embedding"], generator=g, dtype=torch.float64) * 0.02)
        uniform("head", -bound, bound)
        self["final_norm"].fill_(1.0)
        for k in range(self.layers):
            L = f"layers/{k:03d}/"
            for name in ("W_delta", "W_B", "W_C"):
                uniform(L + name, -bound, bound)
            dt0 = torch.exp(torch.rand(self.width, generator=g, dtype=torch.float64)
                            * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
            self[L + "b_delta"].copy_(dt0 + torch.log(-torch.expm1(-dt0)))  # softplus⁻¹
            self[L + "A_log"].copy_(torch.log(torch.arange(1, self.state + 1, dtype=torch.float64)).expand(
                self.width, self.state))
            self[L + "D"].fill_(1.0)
            self[L + "norm"].fill_(1.0)

    @torch.no_grad()
    def load_checkpoint(self, f):
        for name, shape in self.shapes.items():
            data = f["/params/" + name][...]
            if data.shape != shape:
                raise SystemExit(f"/params/{name}: shape {data.shape}, expected {shape}")
            self[name].copy_(torch.from_numpy(data))

    def layer(self, y, k):
        L = f"layers/{k:03d}/"
        yh = rms_norm(y, self[L + "norm"])                                     # [B, T, P]
        delta = F.softplus(yh @ self[L + "W_delta"].T + self[L + "b_delta"])   # [B, T, P]
        A = torch.exp(delta[..., None] * -torch.exp(self[L + "A_log"]))       # [B, T, P, N]
        beta = yh @ self[L + "W_B"].T                                          # [B, T, N]
        gamma = yh @ self[L + "W_C"].T                                         # [B, T, N]
        u = (delta * yh)[..., None] * beta[:, :, None, :]                      # [B, T, P, N]
        h = chunked_scan(A, u, self.chunk)
        return y + (h @ gamma[..., None])[..., 0] + self[L + "D"] * yh

    def forward(self, x):
        """Mean cross-entropy of next-token targets: batch·(T−1) terms."""
        y = self["embedding"][x]
        for k in range(self.layers):
            y = self.layer(y, k)
        logits = rms_norm(y, self["final_norm"]) @ self["head"].T
        return F.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), x[:, 1:].reshape(-1))


def add_model_arguments(ap, width, layers):
    """--vocab/--width/--state/--layers/--batch/--seed/--checkpoint, shared with mamba_baseline.py."""
    ap.add_argument("--width", type=int, default=width)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234, help="initialisation seed when no --checkpoint")
    ap.add_argument("--checkpoint", help="ash checkpoint (HDF5) to take the parameters and sizes from")


def model_from_arguments(args, make):
    """(model, source): make(vocab, width, state, layers) with the parameters of --checkpoint
    (its sizes override the flags) or seeded from --seed."""
    if args.checkpoint:
        with h5py.File(args.checkpoint, "r") as f:
            model = make(*[int(f.attrs[a]) for a in ("vocab", "width", "state", "layers")])
            model.load_checkpoint(f)
        return model, args.checkpoint
    model = make(args.vocab, args.width, args.state, args.layers)
    model.init_seeded(args.seed)
    return model, f"seed {args.seed}"


def synthetic_ids(n, vocab):
    # uint64 multiplication wraps mod 2^64, as size_t does in bench_grad.cpp
    return (np.arange(n, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(vocab)


def current_rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def saved_tensor_bytes(model, x):
    """Bytes of the distinct storages autograd saves for backward in one step."""
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def timed_steps(model, x, reps, cuda):
    """Seconds of each of `reps` forward + loss.backward() (between synchronisations on a GPU), and the loss."""
    times = []
    for _ in range(reps):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, loss


def run(model, T, batch, reps, device):
    cuda = device.type == "cuda"
    x = torch.from_numpy(synthetic_ids(batch * T, model.vocab).astype(np.int64).reshape(batch, T)).to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    saved = saved_tensor_bytes(model, x)  # doubles as the warm-up pass
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        per_t_peak = True
    else:
        base = current_rss_bytes()
        per_t_peak = reset_rss_peak()
    times, loss = timed_steps(model, x, reps, cuda)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    med = statistics.median(times)
    return {"engine": "pytorch-chunked", "T": T, "batch": batch, "seconds": med, "best_seconds": min(times),
            "us_per_token": 1e6 * med / (batch * T), "loss": loss.item(), "peak_bytes": peak,
            "peak_per_T": per_t_peak, "base_bytes": base, "saved_bytes": saved, "device": str(device)}


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", default="1024,4096,16384", help="comma-separated context lengths")
    add_model_arguments(ap, width=64, layers=2)
    ap.add_argument("--chunk", type=int, default=64, help="tokens per chunk of the scan")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per T (after one warm-up)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--precision", choices=("float", "double"), default="float")
    ap.add_argument("--json", help="append one JSON line per T to this file")
    ap.add_argument("--write-tokens", metavar="FILE.u32",
                    help="also write the batch*T ids as a little-endian uint32 token file for `ash grad` "
                         "(needs a single --T)")
    args = ap.parse_args()
    Ts = [int(t) for t in args.T.split(",")]
    if min(Ts) < 2 or args.batch < 1 or args.chunk < 1 or args.reps < 1 or args.threads < 1:
        ap.error("need T >= 2 and batch, chunk, reps, threads >= 1")
    if args.write_tokens and len(Ts) != 1:
        ap.error("--write-tokens needs exactly one --T value")

    torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no GPU")
    device = torch.device(args.device)
    dtype = torch.float32 if args.precision == "float" else torch.float64
    model, source = model_from_arguments(args, lambda *dims: SSMModel(*dims, dtype, args.chunk))
    model.to(device)
    if args.write_tokens:
        synthetic_ids(args.batch * Ts[0], model.vocab).astype("<u4").tofile(args.write_tokens)

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"# torch {torch.__version__}, {where}, {args.precision}; "
          f"V={model.vocab} P={model.width} N={model.state} K={model.layers} batch={args.batch} "
          f"chunk={args.chunk}; parameters from {source}")
    print(f"{'T':>8} {'best s':>10} {'median s':>10} {'us/token':>10} {'loss':>13} {'peak RSS':>12} "
          f"{'saved':>12}")
    for T in Ts:
        try:
            row = run(model, T, args.batch, args.reps, device)
        except torch.cuda.OutOfMemoryError:
            print(f"{T:>8}  out of memory on {torch.cuda.get_device_name()}", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps({"engine": "pytorch-chunked", "T": T, "batch": args.batch, "oom": True,
                                        "device": str(device), "torch": torch.__version__}) + "\n")
            break
        row.update(threads=args.threads, torch=torch.__version__, precision=args.precision, chunk=args.chunk,
                   vocab=model.vocab, width=model.width, state=model.state, layers=model.layers)
        print(f"{T:>8} {row['best_seconds']:>10.4f} {row['seconds']:>10.4f} {row['us_per_token']:>10.2f} "
              f"{row['loss']:>13.10g} {mib(row['peak_bytes']):>12} {mib(row['saved_bytes']):>12}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
