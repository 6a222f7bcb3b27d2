"""adjoint_sharding.torch.wrap against the same transformers MambaForCausalLM unwrapped:
one training step (forward, loss.backward()) each, its time, the bytes autograd saves
for the backward and the peak RSS over the process's resident size before the step
(docs/python.md, "PyTorch: adjoint_sharding.torch.wrap").

    PYTHONPATH=build/python python perf_tests/torch_wrap_memory.py --T 2048 --layers 4

Each model runs in its own process (a fresh RSS high-water mark); the loss and the
gradient norm of both are printed so that the two runs can be seen to agree."""
import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def one_step(args):
    import torch
    import transformers
    from proc_memory import reset_rss_peak, vm_kib

    cfg = transformers.MambaConfig(vocab_size=args.vocab, hidden_size=args.width, state_size=args.state,
                                   num_hidden_layers=args.layers, use_cache=False)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(cfg).train()
    if args.mode == "wrapped":
        from adjoint_sharding.torch import wrap
        wrap(model)
    ids = torch.randint(0, args.vocab, (args.batch, args.T), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids[:, :8], labels=ids[:, :8]).loss.backward()  # warm-up: lazy imports, allocator
    model.zero_grad(set_to_none=True)
    params = {p.data_ptr() for p in model.parameters()}
    saved = [0]

    def pack(t):
        if t.data_ptr() not in params:
            saved[0] += t.numel() * t.element_size()
        return t

    rss0 = vm_kib("VmRSS")
    reset_rss_peak()
    t0 = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    dt = time.perf_counter() - t0
    gnorm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    return {"mode": args.mode, "loss": loss.item(), "grad_norm": gnorm, "seconds": dt,
            "saved_MiB": saved[0] / 2**20, "peak_rss_over_start_MiB": (vm_kib("VmHWM") - rss0) / 1024}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--mode", choices=["wrapped", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one_step(args)))
        return
    print(f"MambaForCausalLM float32, D={args.width} (E={2 * args.width}), N={args.state}, K={args.layers}, "
          f"V={args.vocab}, batch {args.batch}, T={args.T}: one training step")
    print(f"{'model':14s} {'loss':>10s} {'|grad|':>10s} {'s/step':>8s} {'saved by autograd':>18s} "
          f"{'peak RSS over start':>20s}")
    for mode in ("wrapped", "transformers"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        r = json.loads(out)
        print(f"{mode:14s} {r['loss']:10.6f} {r['grad_norm']:10.6f} {r['seconds']:8.2f} "
              f"{r['saved_MiB']:14.1f} MiB {r['peak_rss_over_start_MiB']:16.1f} MiB")


if __name__ == "__main__":
    main()
