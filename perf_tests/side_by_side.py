"""The side-by-side protocol of mamba_vs_ash.py and mamba_block_vs_ash.py (issue 44, item 5).

Both sides are measured alike:
- warm: one untimed warm-up step per point on each side, then --reps (>= 5 on a GPU) timed steps;
  min and median are reported for both;
- theirs (torch): each step (zero_grad, forward, loss.backward()) between two torch.cuda.Event
  records on the current stream (elapsed_time after the end event's synchronize); on the CPU,
  time.perf_counter around the step;
- ours (ash_bench_grad, a process per point): its own steady_clock around `engine.compute`
  and the Kokkos::fence after it, in the process, after its warm-up; process start-up, Kokkos'
  and CUDA's initialisation, parameter initialisation and the token upload are outside it; the
  engine keeps its buffers from call to call (--keep-buffers 1, its default), so a warm call
  allocates only the head's chunk buffers, as torch's caching allocator serves theirs;
- peaks: theirs torch.cuda.max_memory_allocated() over the warm-up and reps of one point (reset
  before the point, so the parameters, the gradients and the tokens are in it); ours
  "peak_total_bytes", the Kokkos high-water mark with the parameters, the gradient buffers
  and the token windows in it;
- losses: at every T both sides measured, on the same weights and tokens; a row whose loss is
  off the other side's by more than the stated relative bound has "loss_ok": false, the table
  marks it and the script exits 1.

Every row is one JSON line with the fields ROW_FIELDS (and extra context fields).
"""
import json
import os
import statistics
import time

ROW_FIELDS = ("side", "mode", "T", "reps", "min_s", "median_s", "peak_bytes", "loss", "loss_ok", "warm")

TIMER_TORCH_CUDA = "torch.cuda.Event around zero_grad + forward + backward, after 1 warm-up"
TIMER_TORCH_CPU = "time.perf_counter around zero_grad + forward + backward, after 1 warm-up"
TIMER_ASH = ("ash_bench_grad in-process steady_clock around compute + Kokkos::fence, after 1 warm-up "
             "(process and CUDA start-up excluded; the engine's buffers kept from call to call, "
             "as a caching allocator's)")
PEAK_TORCH = "torch.cuda.max_memory_allocated over the point (parameters, gradients, tokens included)"
PEAK_ASH = "ash_bench_grad peak_total_bytes (parameters, gradient buffers, tokens included)"


def timed_steps(step, reps, cuda, torch=None):
    """Seconds of `reps` calls of step() (which returns the loss) and the last loss; CUDA events on a GPU."""
    times, loss = [], None
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            loss = step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t0)
    return times, loss


def train_step(model, x):
    """The step both torch scripts time: a fresh gradient of the model's loss on x."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
        return loss
    return step


def measure(torch, step, reps, cuda):
    """One point of theirs: peak reset, one untimed warm-up, `reps` timed steps.
    Returns (times, loss, peak_bytes); peak is None off a GPU."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    step()  # warm-up: neither timed nor counted
    times, loss = timed_steps(step, reps, cuda, torch)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return times, float(loss.detach()) if loss is not None else None, peak


def make_row(side, mode, T, times, peak_bytes, loss, warm=True, **extra):
    """A row with every field of ROW_FIELDS; loss_ok is set by mark_losses."""
    row = {"side": side, "mode": mode, "T": T, "reps": len(times) if times else 0,
           "min_s": min(times) if times else None, "median_s": statistics.median(times) if times else None,
           "peak_bytes": peak_bytes, "loss": loss, "loss_ok": None, "warm": warm}
    row.update(extra)
    return row


def ash_row(bench, mode, **extra):
    """Our row from one ash_bench_grad JSON row (its "times": every timed rep)."""
    times = bench.get("times") or []
    extra.setdefault("timer", TIMER_ASH)
    extra.setdefault("peak", PEAK_ASH)
    for k in ("batch", "width", "state", "layers", "vocab", "arch", "engine", "e3_form", "matmul", "space"):
        if k in bench:
            extra.setdefault(k, bench[k])
    return make_row("ash", mode, bench["T"], times, bench.get("peak_total_bytes"), bench.get("loss"),
                    warm=True, **extra)


def mark_losses(rows, key, rtol):
    """Sets loss_ok on every row with a loss: True where it agrees with the reference side's row of
    the same key (ash's, else every other side's) within rtol, False where not, None where nothing
    to compare. Returns the keys with a mismatch."""
    ours = {key(r): r for r in rows if r["side"] == "ash" and r.get("loss") is not None}
    bad = []
    for r in rows:
        if r.get("loss") is None:
            continue
        if r["side"] == "ash":
            others = [o for o in rows if o["side"] != "ash" and o.get("loss") is not None and key(o) == key(r)]
            errs = [abs(r["loss"] - o["loss"]) / abs(o["loss"]) for o in others]
        else:
            ref = ours.get(key(r))
            errs = [abs(r["loss"] - ref["loss"]) / abs(ref["loss"])] if ref else []
        if not errs:
            continue
        r["loss_rel_diff"] = max(errs)
        r["loss_rtol"] = rtol
        r["loss_ok"] = bool(max(errs) <= rtol)
        if not r["loss_ok"] and key(r) not in bad:
            bad.append(key(r))
    return bad


def print_row(row):
    """One line of a sweep's progress: T, mode, min and median seconds, µs/token, loss, peak."""
    if row.get("median_s") is None:
        print(f"{row['T']:>9} {row['mode']:>10}  {row.get('note') or 'not measured'}", flush=True)
        return
    peak = f"{row['peak_bytes'] / 2**20:.1f} MiB" if row.get("peak_bytes") is not None else "-"
    loss = "-" if row.get("loss") is None else f"{row['loss']:.10g}"
    print(f"{row['T']:>9} {row['mode']:>10} {row['min_s']:>10.4f} {row['median_s']:>10.4f} "
          f"{1e6 * row['median_s'] / ((row.get('batch') or 1) * row['T']):>10.3f} {loss:>13} {peak:>12}", flush=True)


PROGRESS_HEAD = f"{'T':>9} {'mode':>10} {'min s':>10} {'median s':>10} {'us/token':>10} {'loss':>13} {'peak':>12}"


def sweep_modes(torch, Ts, modes, point, emit, reps, max_seconds=0, deadline=0, batch=1):
    """Theirs' sweep: T upward, every mode at each T (point(T, mode) -> row). A mode ends its own
    series at out of memory, or where its next warm-up and reps would pass max_seconds; nothing
    starts after `deadline` seconds. Each row (an out-of-memory row too) goes to emit(row)."""
    t_start, last, done = time.monotonic(), {}, set()
    for T in Ts:
        for mode in modes:
            if mode in done:
                continue
            if deadline and time.monotonic() - t_start > deadline:
                print(f"{T:>9} {mode:>10}  not measured: deadline", flush=True)
                return
            prev = last.get(mode)
            if max_seconds and prev and prev["median_s"] * T / prev["T"] * (reps + 1) > max_seconds:
                print(f"{T:>9} {mode:>10}  not measured: about {prev['median_s'] * T / prev['T']:.1f} s a step, "
                      f"over the per-point cap of {max_seconds:g} s", flush=True)
                done.add(mode)
                continue
            try:
                row = point(T, mode)
            except torch.cuda.OutOfMemoryError:
                row = make_row("mamba-ssm", mode, T, [], None, None, batch=batch, oom=True, note="out of memory")
            if row.get("oom") or row.get("median_s") is None:
                done.add(mode)
            else:
                last[mode] = row
            emit(row)


def write_rows(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_rows(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _num(v, fmt):
    return "-" if v is None else format(v, fmt)


def table(rows, group=()):
    """Markdown table of the rows: grouped by the `group` fields, then T, then side and mode;
    the time and peak ratios are against ash's row of the same group and T."""
    key = lambda r: tuple(r.get(g) for g in group) + (r.get("T") or 0,)  # noqa: E731
    ours = {key(r): r for r in rows if r["side"] == "ash"}
    head = [g for g in group] + ["T", "side", "mode", "reps", "min s", "median s", "ash / row time", "peak MiB",
                                 "ash / row peak", "loss", "loss ok", "note"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(rows, key=lambda r: (key(r), r["side"] != "ash", r["side"], str(r.get("mode")))):
        a = ours.get(key(r))
        tr = a["median_s"] / r["median_s"] if a and a is not r and a.get("median_s") and r.get("median_s") else None
        pr = a["peak_bytes"] / r["peak_bytes"] if a and a is not r and a.get("peak_bytes") and r.get("peak_bytes") \
            else None
        ok = {True: "yes", False: "**NO**", None: "-"}[r.get("loss_ok")]
        cells = [str(r.get(g)) for g in group] + [
            str(r.get("T")), r["side"], str(r.get("mode")), str(r.get("reps")), _num(r.get("min_s"), ".4f"),
            _num(r.get("median_s"), ".4f"), _num(tr, ".2f"),
            _num(r["peak_bytes"] / 2**20 if r.get("peak_bytes") else None, ".1f"), _num(pr, ".3f"),
            _num(r.get("loss"), ".7f"), ok, r.get("note", "")]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def definitions(rtol):
    """The lines under every table: what the columns measure."""
    return "\n".join([
        f"- theirs' time: {TIMER_TORCH_CUDA} (on the CPU: {TIMER_TORCH_CPU}); ours: {TIMER_ASH}.",
        f"- theirs' peak: {PEAK_TORCH}; ours: {PEAK_ASH}.",
        "- ash / row time: ash's median time over the row's (above 1: ash slower); ash / row peak: ash's peak "
        "over the row's.",
        f"- loss ok: the row's loss within {rtol:g} (relative) of the other side's at the same T and shape.",
    ]) + "\n"
