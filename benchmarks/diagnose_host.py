"""The monitor's host work per step, apart from its kernels (CPU):

    python benchmarks/diagnose_host.py [--steps 40] [--config full|default]
    python benchmarks/diagnose_host.py --device cuda [--profile 25]   # real launches (GPU)

The GPT-2-small-shaped model of bench_overhead at 12 layers, shrunk to a width the CPU runs in
a few ms (d 32, sequence 8), without and with the monitor, statistics launches replaced by
no-ops: what is left is the hooks, the bookkeeping and the frame's detectors and records, the
work that makes full coverage host-bound on machines whose host is slower than their GPU
(benchmarks/RESULTS.md, "Host work per step"). Printed: ms per step in the forward, the
backward, the optimizer step (with the taps around it) and the step's end (frames, detectors,
records).

--device cuda keeps the kernels: the same tiny model on the GPU, whose kernels finish long
before the host has launched them, so each part's time is the host's, launches included.
--profile N also prints the N functions with the most own time, and with the most time
including their callees, in more monitored steps profiled apart from the timed ones.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time

import torch

import stabilitywatch as sw
from stabilitywatch import monitor as _monitor
from stabilitywatch.stats.backend import RowBackend

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_overhead import build, full_coverage, loss_fn  # noqa: E402

PARTS = ("forward", "backward", "optimizer", "step end")


def _steps(model, opt, batch, mon, first: int, n: int) -> list[float]:
    # ms per step in each of PARTS
    acc = [0.0] * len(PARTS)
    for i in range(first, first + n):
        ctx = mon.step(i, batch=batch) if mon else None
        t = [time.perf_counter()]
        if ctx:
            ctx.__enter__()
        loss = loss_fn(model, batch)
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        if mon:
            mon.observe_loss(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        if ctx:
            ctx.__exit__(None, None, None)
        t.append(time.perf_counter())
        for k in range(len(PARTS)):
            acc[k] += t[k + 1] - t[k]
    return [a / n * 1e3 for a in acc]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", choices=("full", "default"), default="full")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--profile", type=int, default=0)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    shapes = dict(vocab=256, dim=32, layers=12, heads=4, seq=8, batch=1)
    saved = _monitor.kernel_backend
    if a.device == "cpu":  # the kernels are not what is timed here
        _monitor.kernel_backend = lambda name: RowBackend(
            "none", lambda *args: None, lambda *args: [], *(lambda *args: False,) * 3)
    try:
        model, opt, batch = build(shapes, a.device)
        _steps(model, opt, batch, None, 0, 5)
        rows = {"no monitor": _steps(model, opt, batch, None, 5, a.steps)}
        cfg = (full_coverage(snapshots=False) if a.config == "full"
               else sw.Config(sinks=("jsonl",), capture={"snapshot": "off"}))
        with tempfile.TemporaryDirectory() as tmp:
            mon = sw.watch(model, opt, config=cfg, run_dir=tmp)
            _steps(model, opt, batch, mon, 0, 12)
            rows[f"{a.config} config"] = _steps(model, opt, batch, mon, 12, a.steps)
            prof = cProfile.Profile() if a.profile else None
            if prof:  # more steps, apart from the timed ones (the profiler's cost is its own)
                prof.enable()
                _steps(model, opt, batch, mon, 12 + a.steps, a.steps)
                prof.disable()
            mon.close()
    finally:
        _monitor.kernel_backend = saved
    if prof:
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof).sort_stats(key).print_stats(a.profile)
    print(f"host ms per step on {a.device}")
    print("| configuration | " + " | ".join(PARTS) + " | total |")
    print("|---|" + "---:|" * (len(PARTS) + 1))
    for name, ms in rows.items():
        print(f"| {name} | " + " | ".join(f"{m:.2f}" for m in ms) + f" | {sum(ms):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
