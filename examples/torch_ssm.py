#!/usr/bin/env python3
"""Train a byte-level language model on fortunes with PyTorch around adjoint_sharding's SSM stack.

embedding (torch) -> SSMStack (the K residual SSM layers; backward = E3 in C++)
-> RMSNorm + head (torch) -> cross-entropy, optimised with torch.optim.AdamW.
Then the same model, from the same initial weights on the same batches, in plain
PyTorch autograd (the chunked scan of perf_tests/torch_baseline.py), and both
losses and peak memory side by side (docs/python.md).

    python examples/torch_ssm.py [--steps 60] [--T 1024] [--batch 2] [--width 64 --state 16 --layers 4]
                                 [--text FILE] [--lr 3e-3] [--threads 2] [--no-baseline]

Text: every fortune file of Debian's `fortunes` package (/usr/share/games/fortunes),
or --text FILE. Memory: the process's resident high-water mark (VmHWM) during the
training steps, reset before each model (Linux /proc/self/clear_refs), minus the
resident size before them; and the bytes autograd saves for the backward in one
step (saved-tensor hooks; for SSMStack that is y0 and the parameters, what the C++
pass needs besides is transient inside backward and included in the VmHWM).
"""
import argparse
import math
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from adjoint_sharding.torch import SSMStack

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf_tests"))
import torch_baseline as tb  # noqa: E402  (the plain-PyTorch model: rms_norm, chunked scan)
from proc_memory import reset_rss_peak, vm_kib  # noqa: E402


def fortunes_text():
    d = pathlib.Path("/usr/share/games/fortunes")
    files = sorted(p for p in d.iterdir() if p.is_file() and p.suffix == "") if d.is_dir() else []
    if not files:
        raise SystemExit("no fortunes in /usr/share/games/fortunes (apt-get install fortunes) - or pass --text FILE")
    return b"".join(p.read_bytes() for p in files)


class AshModel(torch.nn.Module):
    def __init__(self, stack, vocab):
        super().__init__()
        P = stack.width
        self.embedding = torch.nn.Parameter(torch.randn(vocab, P) * 0.02)
        self.stack = stack
        self.final_norm = torch.nn.Parameter(torch.ones(P))
        self.head = torch.nn.Parameter(torch.empty(vocab, P).uniform_(-1 / math.sqrt(P), 1 / math.sqrt(P)))

    def forward(self, x):
        y = self.stack(self.embedding[x])
        logits = tb.rms_norm(y, self.final_norm) @ self.head.T
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


def plain_model(ash_model, vocab, chunk):
    """torch_baseline.SSMModel holding the same initial weights (its forward is the same loss)."""
    s = ash_model.stack
    m = tb.SSMModel(vocab, s.width, s.state, s.num_layers, torch.float32, chunk)
    with torch.no_grad():
        m["embedding"].copy_(ash_model.embedding)
        m["final_norm"].copy_(ash_model.final_norm)
        m["head"].copy_(ash_model.head)
        for name, arr in s.arrays().items():
            m[name].copy_(torch.from_numpy(arr))
    return m


def train(name, model, batches, lr, log_every):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    saved = tb.saved_tensor_bytes(model, batches[0])
    base = vm_kib("VmRSS")
    per_run = reset_rss_peak()
    losses, t0 = [], time.perf_counter()
    for step, x in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % log_every == 0 or step == len(batches) - 1:
            print(f"[{name}] step {step:4d}  loss {loss.item():.4f}  ({loss.item() / math.log(2):.3f} bits/byte)",
                  flush=True)
    secs = time.perf_counter() - t0
    peak = vm_kib("VmHWM")
    return {"losses": losses, "seconds": secs, "peak_mib": (peak - base) / 1024, "hwm_mib": peak / 1024,
            "saved_mib": saved / 2**20, "per_run_peak": per_run}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", help="train on this file instead of the fortunes")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--no-baseline", action="store_true", help="skip the plain PyTorch model")
    ap.add_argument("--storage", default="float", help="SSMStack storage: float, bf16, fp16")
    ap.add_argument("--layer-checkpoint", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    data = pathlib.Path(a.text).read_bytes() if a.text else fortunes_text()
    ids = torch.from_numpy(np.frombuffer(data, np.uint8).astype(np.int64))
    print(f"text: {len(data)} bytes; model P={a.width} N={a.state} K={a.layers}, T={a.T}, batch {a.batch}, "
          f"{a.steps} steps, AdamW lr {a.lr}")
    g = torch.Generator().manual_seed(a.seed)
    starts = torch.randint(0, len(ids) - a.T, (a.steps, a.batch), generator=g)
    batches = [torch.stack([ids[s:s + a.T] for s in row.tolist()]) for row in starts]

    stack = SSMStack(a.width, a.state, a.layers, dtype=torch.float32, seed=a.seed + 1, chunk=a.chunk,
                     storage=a.storage, layer_checkpoint=a.layer_checkpoint)
    model = AshModel(stack, 256)
    plain = None if a.no_baseline else plain_model(model, 256, a.chunk)
    r = train("adjoint_sharding", model, batches, a.lr, a.log_every)
    rows = [("adjoint_sharding SSMStack (E3)", r)]
    if plain is not None:
        rows.append(("plain PyTorch autograd", train("pytorch", plain, batches, a.lr, a.log_every)))
    print()
    print(f"{'model':32s} {'first loss':>10s} {'last loss':>10s} {'s/step':>8s} {'saved by autograd':>18s} "
          f"{'peak RSS over start':>20s}")
    for name, x in rows:
        print(f"{name:32s} {x['losses'][0]:10.4f} {x['losses'][-1]:10.4f} {x['seconds'] / len(x['losses']):8.3f} "
              f"{x['saved_mib']:15.1f} MiB {x['peak_mib']:16.1f} MiB")
    if not r["per_run_peak"]:
        print("(this kernel does not allow resetting the high-water mark: peaks are cumulative)")
    if r["losses"][-1] >= r["losses"][0]:
        raise SystemExit("the loss did not fall")


if __name__ == "__main__":
    main()
