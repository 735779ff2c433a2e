"""The training thread's host time on a sampled step, by part (`diagnose_record.py --step`).

The HF Llama of bench_steps.py (GPU: 8 layers, d 1024, batch 8 x 1024, bf16 autocast, fused
AdamW; CPU: its smoke size) runs sampled steps with and without the monitor, the runs
interleaved. Each part of the step is timed on the training thread (`time.thread_time`): the
step's start (`mon.step` entered: the weight taps), the forward (output records, gradient hooks
registered), the backward (gradient-output records), `opt.step()` (the sentinel, gradient,
update and optimizer-state taps) and the step's end. The monitored runs also count the rows
written in each part and time the row backend's own calls apart (the kernel launches on the GPU,
the pure-torch statistics on the CPU, where `backend="torch"` stands in for the launch; the
gradient sentinel's launch or pure-torch twin too); one
more step per part counts the Python function calls of that part outside the backend
(`sys.setprofile`), which do not depend on the machine's speed or load. "host" is the monitor's
part less the backend's time: the record path's own Python and torch bookkeeping (and ~1 us per
backend call of the timing itself).
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_steps  # noqa: E402

import stabilitywatch as sw  # noqa: E402

PARTS = ("begin", "forward", "backward", "optimizer", "end")


class _Clock:
    """Per-part training-thread time of one step; `part` is the part now running. With
    `counting` set to a part, that part's Python function calls are counted instead."""

    def __init__(self):
        self.part = "outside"
        self.ms: dict = {}
        self.counting = None
        self.calls: dict = {}
        self.inside = 0   # > 0 while the row backend runs: its calls are not the record path's

    def run(self, part: str, fn, *args):
        if part == self.counting:
            self.calls[part], got = _python_calls(self, fn, *args)
            return got
        self.part = part
        t0 = time.thread_time()
        try:
            return fn(*args)
        finally:
            self.ms[part] = self.ms.get(part, 0.0) + (time.thread_time() - t0) * 1e3
            self.part = "outside"


def _step(model, opt, ids, mon, i, device, clock: _Clock) -> None:
    ctx = mon.step(i) if mon is not None else bench_steps._null()
    clock.run("begin", ctx.__enter__)
    try:
        def forward():
            with torch.autocast(device, dtype=torch.bfloat16):
                return model(input_ids=ids).logits
        logits = clock.run("forward", forward)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                               ids[:, 1:].reshape(-1))
        del logits
        clock.run("backward", loss.backward)
        if mon is not None:
            mon.observe_loss(loss)
        clock.run("optimizer", opt.step)
        opt.zero_grad(set_to_none=True)
    finally:
        clock.run("end", ctx.__exit__, None, None, None)


def _config(kind: str, device: str):
    cfg = bench_steps.config(kind)
    if cfg is not None and device == "cpu":
        cfg = cfg.replace(backend="torch")   # the statistics timed apart through the backend
    return cfg


def _instrument(mon, clock: _Clock, rows: Counter, inside: Counter) -> None:
    """Count each part's rows and time the row backend's calls (the kept multi-tensor and
    sentinel launches too, and the sentinel's pure-torch twin) into `inside`, on this
    monitor's buffer only."""
    buf = mon.buffer

    def timed(fn):
        def call(*args, **kw):
            clock.inside += 1
            t0 = time.thread_time()
            try:
                return fn(*args, **kw)
            finally:
                inside[clock.part] += (time.thread_time() - t0) * 1e3
                clock.inside -= 1
        return call

    class _Launch:   # a kept launch, run again on later steps
        def __init__(self, launch):
            self.launch = launch
            self.run = timed(launch.run)

        def rebind(self, addrs):
            return self.launch.rebind(addrs)

    ops = buf.ops
    many, sentinel = ops.accumulate_many, ops.sentinel_launch

    def accumulate_many(ts, out, slots):
        return [(_Launch(lk), src) for lk, src in timed(many)(ts, out, slots)]

    def sentinel_launch(grads, out, rows):
        return _Launch(timed(sentinel)(grads, out, rows))
    buf.ops = buf.sentinel.ops = dataclasses.replace(
        ops, accumulate=timed(ops.accumulate), accumulate_many=accumulate_many,
        accumulate_each=ops.accumulate_each and timed(ops.accumulate_each),
        sentinel_launch=sentinel and sentinel_launch)
    buf._accumulate = buf.ops.accumulate
    buf.sentinel._twin = timed(buf.sentinel._twin)   # the sentinel's pure-torch twin (CPU)
    buf._flush_stage = timed(buf._flush_stage)
    add, add_many = buf.add, buf.add_many

    def count_add(*args, **kw):
        rows[clock.part] += 1
        return add(*args, **kw)

    def count_many(items, *args, **kw):
        rows[clock.part] += len(items)
        return add_many(items, *args, **kw)
    buf.add, buf.add_many = count_add, count_many


def _python_calls(clock: _Clock, fn, *args) -> tuple:
    calls = [0]

    def prof(frame, event, arg):
        if event in ("call", "c_call") and not clock.inside:
            calls[0] += 1
    sys.setprofile(prof)
    try:
        got = fn(*args)
    finally:
        sys.setprofile(None)
    return calls[0], got


def run(kind: str, device: str, smoke: bool, steps: int, out: str, mode: str) -> dict:
    """mode: "time" (parts' ms per step, and with the monitor its rows and the backend's ms,
    medians) or "calls" (Python calls per part outside the backend, one step)."""
    model, _, opt, ids = bench_steps.build("llama", device, smoke)
    cfg = _config(kind, device)
    mon = sw.watch(model, opt, config=cfg, run_dir=out) if cfg is not None else None
    clock, rows, inside = _Clock(), Counter(), Counter()
    per_step: dict = {p: [] for p in PARTS}
    extra: dict = {"rows": {p: [] for p in PARTS}, "backend": {p: [] for p in PARTS}}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        if mon is not None:
            _instrument(mon, clock, rows, inside)
        warm = 1 if smoke else 3
        for i in range(warm + (len(PARTS) if mode == "calls" else steps)):
            clock.ms, before_rows, before_in = {}, Counter(rows), Counter(inside)
            # "calls": one part counted per step, the profiler's cost kept out of the others
            clock.counting = PARTS[i - warm] if mode == "calls" and i >= warm else None
            _step(model, opt, ids, mon, i, device, clock)
            sync()
            if i >= warm:
                for p in PARTS:
                    per_step[p].append(clock.ms.get(p, 0.0))
                    extra["rows"][p].append(rows[p] - before_rows[p])
                    extra["backend"][p].append(inside[p] - before_in[p])
    finally:
        if mon is not None:
            mon.close()
    if mode == "calls":
        return {"calls": clock.calls}
    med = {p: statistics.median(v) for p, v in per_step.items()}
    return {"ms": med, "rows": {p: statistics.median(v) for p, v in extra["rows"].items()},
            "backend": {p: statistics.median(v) for p, v in extra["backend"].items()}}


def main(kind: str, device: str, smoke: bool, steps: int, repeats: int) -> int:
    base, mon, calls, base_calls = [], [], None, None
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            base.append(run("none", device, smoke, steps, f"{tmp}/n{r}", "time"))
            mon.append(run(kind, device, smoke, steps, f"{tmp}/m{r}", "time"))
        calls = run(kind, device, smoke, 1, f"{tmp}/p", "calls")["calls"]
        base_calls = run("none", device, smoke, 1, f"{tmp}/pn", "calls")["calls"]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"# sampled step by part: llama{' (smoke size)' if smoke else ''}, "
          f"Config {kind!r}{' with backend torch' if device == 'cpu' else ''}, {name}, "
          f"torch {torch.__version__}, {steps} steps x {repeats} rounds (medians)")
    print("| part | unmonitored ms | monitored ms | monitor's part ms | rows | backend ms | "
          "host ms | host us per row | Python calls (monitor's) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    tot = Counter()
    for p in PARTS:
        b = statistics.median(x["ms"][p] for x in base)
        m = statistics.median(x["ms"][p] for x in mon)
        n = statistics.median(x["rows"][p] for x in mon)
        inside = statistics.median(x["backend"][p] for x in mon)
        host = m - b - inside
        extra_calls = calls.get(p, 0) - base_calls.get(p, 0)
        for k, v in (("b", b), ("m", m), ("n", n), ("in", inside), ("host", host),
                     ("calls", extra_calls)):
            tot[k] += v
        per_row = f"{host / n * 1e3:.1f}" if n else ""
        print(f"| {p} | {b:.2f} | {m:.2f} | {m - b:+.2f} | {n:.0f} | {inside:.2f} | "
              f"{host:+.2f} | {per_row} | {extra_calls} |")
    per_row = f"{tot['host'] / tot['n'] * 1e3:.1f}" if tot["n"] else ""
    print(f"| step | {tot['b']:.2f} | {tot['m']:.2f} | {tot['m'] - tot['b']:+.2f} | "
          f"{tot['n']:.0f} | {tot['in']:.2f} | {tot['host']:+.2f} | {per_row} | "
          f"{tot['calls']:.0f} |")
    return 0
